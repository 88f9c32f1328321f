"""Measure the parallel strategies side by side on this machine: samples/s and memory per process.

    python -m psrec.bench.parallel_bench [--steps 20] [--batch 1024] [--rounds 2] [--json out.json]

Two workloads, each on synthetic data generated in memory (no reader in the loop), every case run
in fresh forked processes (`run_local_group`), rounds interleaved so machine noise hits all alike:

- CTR (DeepFM, 26 tables of dim 16, Zipf ids over 200k per table, global batch 2 x `--batch`):
  one process with in-process shards (the PS's compute without its network), and collective
  sharding over 2 ranks, row-wise and table-wise (gloo all-to-all on loopback).
- Sequence (SASRec, dim 64, 4 blocks, length 50, global batch `--batch`): the unsplit model in one
  process, a 2-stage pipeline (GPipe and 1F1B, 4 micro-batches), and 2 data-parallel replicas.

Reported per case: median samples/s over rounds, and per process the bytes of embedding rows it holds
(CTR) or of the dense parameters of its stage (sequence). The PS over Ray is measured by
`psrec/bench/ps_bench.py`. Numbers go into docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import numpy as np
import torch

from psrec.data.batch import Batch, SparseBatch, concat_batches
from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.models import DeepFM, ModelInput, SASRec
from psrec.parallel.collective import CollectiveConnection, collective_client
from psrec.parallel.launch import run_local_group
from psrec.parallel.pipeline import PipelineLayout, PipelineStepper
from psrec.parallel.row_owners import Placement
from psrec.ps.client import LocalConnection, linear_table_name
from psrec.ps.shard import ParameterShard
from psrec.trainer.lookup import BatchLookup, batch_lookup
from psrec.trainer.step import StepRunner

logger = logging.getLogger(__name__)

NUM_TABLES, CTR_DIM, ID_SPACE = 26, 16, 200_000
SEQ_DIM, SEQ_LENGTH, SEQ_BLOCKS = 64, 50, 4
WARMUP = 3


def _tables() -> dict[str, EmbeddingTable]:
    spec = SparseOptimizerSpec(name="rowwise_adagrad", lr=0.05)
    tables = {}
    for i in range(NUM_TABLES):
        name = f"C{i + 1}"
        tables[name] = EmbeddingTable(name, CTR_DIM, optimizer=spec, seed=i)
        tables[linear_table_name(name)] = EmbeddingTable(
            linear_table_name(name), 1, optimizer=spec, seed=100 + i
        )
    return tables


def _ctr_batches(seed: int, count: int, size: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        features = {
            f"C{i + 1}": (np.minimum(rng.zipf(1.2, size), ID_SPACE).astype(np.int64), np.ones(size, np.int32))
            for i in range(NUM_TABLES)
        }
        batches.append(
            Batch(
                labels=rng.integers(0, 2, size).astype(np.float32),
                dense=rng.normal(size=(size, 13)).astype(np.float32),
                sparse=SparseBatch.from_features(features),
            )
        )
    return batches


def _ctr_runner(client: BatchLookup, world_size: int) -> StepRunner:
    torch.manual_seed(0)
    model = DeepFM(13, NUM_TABLES, CTR_DIM, hidden_sizes=(256, 128), batch_norm=False, dropout=0.0)
    return StepRunner(model, torch.optim.Adam(model.parameters(), lr=1e-3), client, world_size=world_size)


def _run_ctr(rank: int, world_size: int, sharding: str, steps: int, batch: int) -> dict[str, Any]:
    features = {f"C{i + 1}": f"C{i + 1}" for i in range(NUM_TABLES)}
    if sharding == "local":
        shard = ParameterShard(0, _tables())
        client = batch_lookup(
            [LocalConnection(shard)],
            np.zeros(1024, np.int64),
            table_dims={name: CTR_DIM for name in features},
            feature_tables=features,
            linear_terms=True,
        )
        per_step = [
            concat_batches(list(group))
            for group in zip(
                _ctr_batches(0, steps + WARMUP, batch), _ctr_batches(1, steps + WARMUP, batch), strict=True
            )
        ]
    else:
        shard = ParameterShard(rank, _tables(), num_trainers=world_size, mode="sync")
        placement = (
            Placement.row_wise(world_size)
            if sharding == "row_wise"
            else Placement.table_wise(sorted(features), world_size)
        )
        dims = {name: table.dim for name, table in shard.tables.items()}
        connection = CollectiveConnection(shard, placement, table_dims=dims)
        client = BatchLookup(collective_client(connection, linear_terms=True), feature_tables=features)
        per_step = _ctr_batches(rank, steps + WARMUP, batch)
    runner = _ctr_runner(client, world_size)
    batches = iter(per_step)
    for _ in runner.run(batches, first_step=0, max_steps=WARMUP):
        pass
    if world_size > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in runner.run(batches, first_step=WARMUP, max_steps=steps):
        pass
    seconds = time.perf_counter() - start
    table_bytes = sum(stats["total"] for stats in shard.stats().values())
    return {
        "seconds": seconds,
        "table_bytes": table_bytes,
        "samples": steps * batch * (2 if sharding == "local" else 1),
    }


def _seq_input(seed: int, size: int) -> tuple[ModelInput, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, SEQ_LENGTH + 1, (size,), generator=generator)
    mask = torch.arange(SEQ_LENGTH).flip(0).unsqueeze(0) < lengths.unsqueeze(1)
    sequences = {
        k: torch.randn(size, SEQ_LENGTH, SEQ_DIM, generator=generator).requires_grad_(True)
        for k in ("seq", "pos", "neg")
    }
    return ModelInput(
        torch.zeros(size, 0), torch.zeros(size, 0, SEQ_DIM), None, sequences, {"seq": mask}
    ), mask.float()


def _sasrec() -> SASRec:
    torch.manual_seed(0)
    return SASRec(SEQ_DIM, max_length=SEQ_LENGTH, num_blocks=SEQ_BLOCKS, num_heads=2, dropout=0.0)


def _run_sequence(rank: int, world_size: int, case: str, steps: int, batch: int) -> dict[str, Any]:
    model = _sasrec()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if case == "unsplit":
        inp, _ = _seq_input(rank, batch)
        parameters = list(model.parameters())

        def one_step() -> None:
            optimizer.zero_grad()
            loss, _ = model.loss(inp)
            loss.backward()
            optimizer.step()

    else:
        num_stages = 1 if case == "data_parallel" else 2
        layout = PipelineLayout(world_size, num_stages)
        schedule = "1f1b" if case == "pipeline_1f1b" else "gpipe"
        stepper = PipelineStepper(model, layout, n_microbatches=4 if num_stages > 1 else 1, schedule=schedule)
        local_batch = batch // layout.num_replicas
        inp, target = _seq_input(layout.replica_of(rank), local_batch)
        parameters = []

        def one_step() -> None:
            nonlocal parameters
            stepper.step(inp if stepper.is_first else None, target if stepper.is_last else None)
            parameters = stepper.stage_parameters()
            optimizer.step()  # parameters of other stages have no gradient and are skipped

    for _ in range(WARMUP):
        one_step()
    if world_size > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    seconds = time.perf_counter() - start
    dense_bytes = sum(p.numel() * p.element_size() for p in parameters)
    return {"seconds": seconds, "dense_bytes": dense_bytes, "samples": steps * batch}


CASES: dict[str, tuple[Any, str, int]] = {
    "CTR: 1 process, in-process shards (batch 2b)": (_run_ctr, "local", 1),
    "CTR: collective row-wise, 2 ranks x b": (_run_ctr, "row_wise", 2),
    "CTR: collective table-wise, 2 ranks x b": (_run_ctr, "table_wise", 2),
    "SASRec: unsplit, 1 process": (_run_sequence, "unsplit", 1),
    "SASRec: 2-stage pipeline, GPipe, 4 micro-batches": (_run_sequence, "pipeline_gpipe", 2),
    "SASRec: 2-stage pipeline, 1F1B, 4 micro-batches": (_run_sequence, "pipeline_1f1b", 2),
    "SASRec: 2 data-parallel replicas": (_run_sequence, "data_parallel", 2),
}


def measure(*, steps: int, batch: int, rounds: int) -> dict[str, dict[str, Any]]:
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, (fn, case, world_size) in CASES.items():
            runs[name].append(
                run_local_group(fn, world_size=world_size, args=(case, steps, batch), timeout=600)
            )
    out = {}
    for name, rounds_results in runs.items():
        rates = [r[0]["samples"] / max(rank["seconds"] for rank in r) for r in rounds_results]
        last = rounds_results[-1]
        memory_key = "table_bytes" if "table_bytes" in last[0] else "dense_bytes"
        out[name] = {
            "samples_per_second": statistics.median(rates),
            memory_key: [rank[memory_key] for rank in last],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1024, help="per rank (CTR) / global (SASRec)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = measure(steps=args.steps, batch=args.batch, rounds=args.rounds)
    for name, result in results.items():
        memory = result.get("table_bytes", result.get("dense_bytes")) or []
        kind = "table bytes" if "table_bytes" in result else "dense parameter bytes"
        mb = ", ".join(f"{m / 1e6:.1f}" for m in memory)
        print(f"{name:<52} {result['samples_per_second']:>10,.0f} samples/s   {kind} per process: {mb} MB")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
