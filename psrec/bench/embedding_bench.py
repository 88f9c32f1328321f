"""Embedding engine benchmark: psrec tables side by side with torch.nn.EmbeddingBag(sparse=True).

Measures, in one run on one core (numba kernels are single-threaded; torch is set to 1 thread):

1. lookup and lookup-or-insert throughput on a 10M-row table, batches of 100k Zipf-distributed ids
   (hash index alone, against ``np.searchsorted`` on the sorted ids, and the full ``pull``, against
   an EmbeddingBag forward that is handed pre-mapped row numbers: no hashing, a fixed vocabulary);
2. fused row-wise Adagrad and Adam update throughput for dim 16/64/128 (batches of 100k unique ids,
   uniform over a 1M-row table, and Zipf batches with duplicates), against ``torch.optim.Adagrad`` /
   ``torch.optim.SparseAdam`` stepping an EmbeddingBag's sparse gradient;
3. bytes per row for fp32/fp16/int8 storage: payload, optimizer state and the overhead (hash index +
   stored ids + per-row metadata), including reserved-but-unused capacity.

Run (about 35 s of CPU, 45-90 s wall on the shared 2-vCPU box, ~4 GB of memory at peak; results
go to docs/benchmarks.md):

    . .venv/bin/activate && python -m psrec.bench.embedding_bench

``--rows``/``--update-rows``/``--batch`` shrink it (e.g. ``--rows 1000000`` for a quick look).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from psrec.embedding import (
    EmbeddingTable,
    HashIndex,
    InitializerSpec,
    SparseOptimizerSpec,
    planned_bytes_per_row,
    warmup,
)

logger = logging.getLogger("embedding_bench")

ZIPF_EXPONENT = 1.05
Batch = TypeVar("Batch")  # what a timed function takes: an id array, or a tensor of row numbers
UNIFORM = InitializerSpec("uniform")  # cheaper to draw than normal where initialisation is not measured


def zipf_ranks(generator: np.random.Generator, size: int, num_ranks: int) -> np.ndarray:
    """``size`` ranks in [0, num_ranks) with P(rank k) ~ 1 / (k + 1) ** ZIPF_EXPONENT (inverse CDF)."""
    # Continuous approximation of the truncated Zipf CDF, inverted.
    exponent = 1.0 - ZIPF_EXPONENT
    uniforms = generator.random(size)
    upper = (num_ranks + 1.0) ** exponent
    ranks = (1.0 + uniforms * (upper - 1.0)) ** (1.0 / exponent) - 1.0
    return np.minimum(ranks.astype(np.int64), num_ranks - 1)


def median_rate(items_per_call: int, calls: list[Callable[[], object]]) -> float:
    """Median items per CPU-second of this thread over the calls, after one untimed warm-up call.

    CPU time, not wall time: the machine is shared, and descheduled time is not the code's cost
    (neighbours still pollute the caches, so rates remain noisy). numba kernels run in the calling
    thread and torch is limited to one thread, so both sides are measured the same way.
    """
    calls[0]()
    rates = []
    for call in calls:
        start = time.thread_time()
        call()
        rates.append(items_per_call / max(time.thread_time() - start, 1e-9))
    return statistics.median(rates)


def millions(rate: float) -> str:
    return f"{rate / 1e6:.1f}M/s"


Row = tuple[str, float, float | None, str]  # (operation, psrec rate, baseline rate, baseline name)


def timed_calls(function: Callable[[Batch], object], batches: list[Batch]) -> list[Callable[[], object]]:
    return [functools.partial(function, batch) for batch in batches]


def bench_lookups(args: argparse.Namespace, generator: np.random.Generator) -> list[Row]:
    """Lookups on a table of ``args.rows`` rows (dim ``args.lookup_dim``)."""
    rows, batch, dim, repeats = args.rows, args.batch, args.lookup_dim, args.repeats
    keys = np.unique(
        generator.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=int(rows * 1.15))
    )
    keys = generator.permutation(keys)[: int(rows * 1.1)]  # ranks 0..rows-1 are stored, the rest are new
    stored = keys[:rows]
    results: list[Row] = []

    index = HashIndex()
    start = time.thread_time()
    for offset in range(0, rows, batch):
        index.lookup_or_insert(stored[offset : offset + batch])
    index_build = rows / (time.thread_time() - start)
    table = EmbeddingTable("bench", dim, optimizer=SparseOptimizerSpec("rowwise_adagrad"))
    start = time.thread_time()
    for offset in range(0, rows, batch):
        table.pull(stored[offset : offset + batch])
    table_build = rows / (time.thread_time() - start)
    sorted_rows = np.argsort(stored)
    sorted_keys = stored[sorted_rows]

    def searchsorted_lookup(ids: np.ndarray) -> np.ndarray:
        positions = np.minimum(np.searchsorted(sorted_keys, ids), rows - 1)
        return np.where(sorted_keys[positions] == ids, sorted_rows[positions], -1)

    zipf = [stored[zipf_ranks(generator, batch, rows)] for _ in range(repeats)]
    uniform = [stored[generator.integers(0, rows, batch)] for _ in range(repeats)]
    mixed = [keys[zipf_ranks(generator, batch, keys.shape[0])] for _ in range(repeats)]
    new_fraction = float(np.mean([np.mean(index.lookup(ids)[0] < 0) for ids in mixed]))
    baseline = "np.searchsorted on sorted ids"
    results.append((f"build: insert {rows:,} new ids in batches (hash index)", index_build, None, ""))
    results.append(
        (f"build: pull(train=True) of new ids, dim {dim} (index + row init)", table_build, None, "")
    )
    for label, batches in (("Zipf", zipf), ("uniform", uniform)):
        results.append(
            (
                f"lookup existing ids, {label} (hash index)",
                median_rate(batch, timed_calls(index.lookup, batches)),
                median_rate(batch, timed_calls(searchsorted_lookup, batches)),
                baseline,
            )
        )
    results.append(
        (
            f"lookup-or-insert, Zipf over 1.1x ids ({new_fraction:.2%} new) (hash index)",
            median_rate(batch, timed_calls(index.lookup_or_insert, mixed)),
            None,
            "",
        )
    )
    del index
    bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=torch.full((rows, dim), 0.01))
    offsets = torch.arange(batch)
    rank_batches = [torch.from_numpy(zipf_ranks(generator, batch, rows)) for _ in range(repeats)]
    with torch.no_grad():
        torch_pull = median_rate(batch, timed_calls(functools.partial(bag, offsets=offsets), rank_batches))
    del bag
    evaluation_pull = functools.partial(table.pull, train=False)
    results.append(
        (
            f"pull(train=False) existing ids, Zipf, dim {dim} (lookup + gather)",
            median_rate(batch, timed_calls(evaluation_pull, zipf)),
            torch_pull,
            "EmbeddingBag forward on pre-mapped row numbers",
        )
    )
    results.append(
        (
            f"pull(train=True), Zipf over 1.1x ids, dim {dim} (lookup-or-insert + init)",
            median_rate(batch, timed_calls(table.pull, mixed)),
            None,
            "",
        )
    )
    args.memory_at_scale = (table.num_rows, table.memory_bytes())
    return results


def bench_updates(args: argparse.Namespace, generator: np.random.Generator) -> list[Row]:
    """Fused row-wise Adagrad and Adam pushes against torch.optim on an EmbeddingBag's sparse grads."""
    results: list[Row] = []
    rows, batch, repeats = args.update_rows, args.batch, args.repeats
    ids = np.arange(rows, dtype=np.int64) * 7919 - 13
    steps = itertools.count(1)
    uniform = [generator.choice(rows, batch, replace=False) for _ in range(repeats)]
    zipf = [zipf_ranks(generator, batch, rows) for _ in range(repeats)]
    unique_fraction = float(np.mean([np.unique(positions).size / batch for positions in zipf]))
    for dim in args.dims:
        grads = generator.normal(size=(batch, dim)).astype(np.float32)
        torch_grads = torch.from_numpy(grads)
        for name, torch_name in (
            ("rowwise_adagrad", "torch.optim.Adagrad"),
            ("adam", "torch.optim.SparseAdam"),
        ):
            table = EmbeddingTable(
                "bench", dim, optimizer=SparseOptimizerSpec(name, lr=0.01), initializer=UNIFORM
            )
            for offset in range(0, rows, batch):
                table.pull(ids[offset : offset + batch])

            def push(positions: np.ndarray, table: EmbeddingTable = table, grads: np.ndarray = grads) -> None:
                table.push(ids[positions], grads, step=next(steps))

            ours = median_rate(batch, timed_calls(push, uniform))
            ours_zipf = median_rate(batch, timed_calls(push, zipf))
            del table
            weight = torch.full((rows, dim), 0.01)  # filled (not lazily zeroed) like psrec's rows
            bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=weight)
            if name == "adam":
                optimizer: torch.optim.Optimizer = torch.optim.SparseAdam(bag.parameters(), lr=0.01)
            else:
                optimizer = torch.optim.Adagrad(bag.parameters(), lr=0.01)

            def torch_step(
                positions: np.ndarray,
                bag: torch.nn.EmbeddingBag = bag,
                optimizer: torch.optim.Optimizer = optimizer,
                torch_grads: torch.Tensor = torch_grads,
                dim: int = dim,
            ) -> None:
                index = torch.from_numpy(positions)[None, :]
                bag.weight.grad = torch.sparse_coo_tensor(
                    index, torch_grads, (rows, dim), check_invariants=False
                )
                optimizer.step()

            theirs = median_rate(batch, timed_calls(torch_step, uniform))
            theirs_zipf = median_rate(batch, timed_calls(torch_step, zipf))
            results.append(
                (f"push {name} dim {dim}: {batch:,} unique ids, uniform", ours, theirs, torch_name)
            )
            results.append(
                (
                    f"push {name} dim {dim}: {batch:,} Zipf ids ({unique_fraction:.0%} unique), ids/s",
                    ours_zipf,
                    theirs_zipf,
                    torch_name,
                )
            )
            del bag, optimizer
            gc.collect()
    return results


def bench_memory(args: argparse.Namespace) -> list[str]:
    lines = []
    rows, dim = args.update_rows, 64
    ids = np.arange(rows, dtype=np.int64)
    num_rows, memory = args.memory_at_scale
    overhead = (memory["index"] + memory["metadata"]) / num_rows
    lines.append(
        f"| {num_rows:,} rows, dim {args.lookup_dim}, fp32, rowwise_adagrad | {memory['payload'] / num_rows:.1f} | "
        f"{memory['optimizer'] / num_rows:.1f} | {memory['index'] / num_rows:.1f} | {memory['metadata'] / num_rows:.1f} "
        f"| {overhead:.1f} | {memory['total'] / num_rows:.1f} |"
    )
    for precision in ("fp32", "fp16", "int8"):
        table = EmbeddingTable(
            "bytes", dim, optimizer=SparseOptimizerSpec("rowwise_adagrad"), precision=precision
        )
        for offset in range(0, rows, args.batch):
            table.pull(ids[offset : offset + args.batch])
        memory = table.memory_bytes()
        live = table.num_rows
        exact_payload = planned_bytes_per_row(dim, precision=precision, optimizer="rowwise_adagrad")[
            "payload"
        ]
        lines.append(
            f"| {live:,} rows, dim {dim}, {precision}, rowwise_adagrad | {memory['payload'] / live:.1f} "
            f"(row: {exact_payload:.0f}) | {memory['optimizer'] / live:.1f} | {memory['index'] / live:.1f} | "
            f"{memory['metadata'] / live:.1f} | {(memory['index'] + memory['metadata']) / live:.1f} | "
            f"{memory['total'] / live:.1f} |"
        )
        del table
        gc.collect()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the lookup table")
    parser.add_argument("--update-rows", type=int, default=1_000_000, help="rows of the update/bytes tables")
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--lookup-dim", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per measurement (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad's own tensors
    began = time.perf_counter()
    logger.info("warmup (numba compile or cache load): %.1fs", warmup())
    generator = np.random.default_rng(args.seed)
    stage = time.process_time()
    lookups = bench_lookups(args, generator)
    logger.info("lookups: %.0fs CPU", time.process_time() - stage)
    stage = time.process_time()
    updates = bench_updates(args, generator)
    logger.info("updates: %.0fs CPU", time.process_time() - stage)
    stage = time.process_time()
    memory_lines = bench_memory(args)
    logger.info("bytes per row: %.0fs CPU", time.process_time() - stage)
    lines = [
        "| operation (ids/s, one core, median of batches) | psrec | baseline | ratio | baseline is |",
        "|---|---|---|---|---|",
    ]
    for label, ours, theirs, baseline_name in lookups + updates:
        baseline = "-" if theirs is None else millions(theirs)
        ratio = "-" if theirs is None else f"{ours / theirs:.1f}x"
        lines.append(f"| {label} | {millions(ours)} | {baseline} | {ratio} | {baseline_name} |")
    lines += [
        "",
        "| bytes per row (incl. reserved capacity) | payload | optimizer | index + ids | count + step | overhead | total |",
        "|---|---|---|---|---|---|---|",
        *memory_lines,
    ]
    logger.info("\n".join(lines))
    wall = time.perf_counter() - began
    logger.info(
        "\ntotal time %.0fs wall, %.0f%% of one core on average", wall, 100 * time.process_time() / wall
    )


if __name__ == "__main__":
    main()
