"""Collective embedding sharding: routing, the exchange, and the oracle (2 ranks x b == 1 process x 2b)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from psrec.data.batch import Batch, SparseBatch, concat_batches
from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.models import DeepFM
from psrec.parallel.collective import CollectiveConnection, collective_client
from psrec.parallel.launch import run_local_group
from psrec.parallel.row_owners import Placement
from psrec.ps.client import LocalConnection, linear_table_name
from psrec.ps.routing import bucket_of
from psrec.ps.shard import ParameterShard
from psrec.trainer.lookup import BatchLookup, batch_lookup
from psrec.trainer.step import StepRunner

TABLES = ("C1", "C2", "C3")
DIM = 4
STEPS = 3
BATCH = 24


def make_tables() -> dict[str, EmbeddingTable]:
    spec = SparseOptimizerSpec(name="rowwise_adagrad", lr=0.1)
    tables = {name: EmbeddingTable(name, DIM, optimizer=spec, seed=i) for i, name in enumerate(TABLES)}
    for i, name in enumerate(TABLES):
        linear = linear_table_name(name)
        tables[linear] = EmbeddingTable(
            linear, 1, optimizer=SparseOptimizerSpec(name="sgd", lr=0.05), seed=10 + i
        )
    return tables


def table_dims() -> dict[str, int]:
    return {name: table.dim for name, table in make_tables().items()}


def make_batches(seed: int, count: int, size: int = BATCH) -> list[Batch]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        features = {
            name: (rng.integers(0, 30, size).astype(np.int64), np.ones(size, np.int32)) for name in TABLES
        }
        batches.append(
            Batch(
                labels=rng.integers(0, 2, size).astype(np.float32),
                dense=rng.normal(size=(size, 2)).astype(np.float32),
                sparse=SparseBatch.from_features(features),
            )
        )
    return batches


def make_model(batch_norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return DeepFM(2, len(TABLES), DIM, hidden_sizes=(8,), batch_norm=batch_norm, dropout=0.0)


def make_runner(client: BatchLookup, world_size: int, batch_norm: bool = False) -> StepRunner:
    model = make_model(batch_norm)
    return StepRunner(model, torch.optim.Adam(model.parameters(), lr=0.01), client, world_size=world_size)


def placement_for(sharding: str, world_size: int) -> Placement:
    if sharding == "row_wise":
        return Placement.row_wise(world_size, num_buckets=16)
    return Placement.table_wise(list(TABLES), world_size, num_buckets=16)


def train_collective(
    rank: int, world_size: int, sharding: str, batches: list[list[Batch]], batch_norm: bool = False
) -> dict[str, Any]:
    shard = ParameterShard(rank, make_tables(), num_trainers=world_size, mode="sync")
    connection = CollectiveConnection(shard, placement_for(sharding, world_size), table_dims=table_dims())
    client = BatchLookup(
        collective_client(connection, linear_terms=True, num_buckets=16),
        feature_tables={t: t for t in TABLES},
    )
    runner = make_runner(client, world_size, batch_norm)
    losses = [r.loss for r in runner.run(iter(batches[rank]), first_step=0, max_steps=STEPS)]
    return {
        "rows": shard.table_rows(),
        "dense": {k: v.clone() for k, v in runner.model.state_dict().items()},
        "losses": losses,
        "bytes_sent": connection.bytes_sent,
    }


def oracle(batches: list[list[Batch]]) -> dict[str, Any]:
    shard = ParameterShard(0, make_tables())
    client = batch_lookup(
        [LocalConnection(shard)],
        np.zeros(16, dtype=np.int64),
        table_dims={t: DIM for t in TABLES},
        feature_tables={t: t for t in TABLES},
        linear_terms=True,
    )
    runner = make_runner(client, 1)
    steps = [concat_batches([per_rank[k] for per_rank in batches]) for k in range(STEPS)]
    losses = [r.loss for r in runner.run(iter(steps), first_step=0, max_steps=STEPS)]
    return {"rows": shard.table_rows(), "dense": runner.model.state_dict(), "losses": losses}


def merge_rows(
    per_rank: list[dict[str, tuple[np.ndarray, np.ndarray]]], table: str
) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([rows[table][0] for rows in per_rank])
    values = np.concatenate([rows[table][1] for rows in per_rank])
    order = np.argsort(ids)
    return ids[order], values[order]


# -- pure parts ----------------------------------------------------------------------------------
def test_row_wise_route_follows_the_bucket_map() -> None:
    placement = Placement.row_wise(2, num_buckets=16)
    ids = np.arange(100, dtype=np.int64)
    routed = placement.route("C1", ids)
    owners = placement.bucket_to_rank[bucket_of(ids, 16)]
    for rank in range(2):
        np.testing.assert_array_equal(np.sort(routed.ids_per_shard[rank]), ids[owners == rank])
    values = ids.astype(np.float32)[:, None]
    np.testing.assert_array_equal(routed.gather(routed.split(values)), values)
    assert [p.size for p in placement.route("C1", ids[:0]).ids_per_shard] == [0, 0]


def test_table_wise_route_sends_everything_to_the_owner_and_linear_tables_follow() -> None:
    placement = Placement.table_wise(["C1", "C2", "C3"], 2)
    ids = np.array([5, 3, 5, 9], dtype=np.int64)
    for table, owner in (("C2", 1), ("C3", 0), (linear_table_name("C2"), 1)):
        routed = placement.route(table, ids)
        np.testing.assert_array_equal(routed.ids_per_shard[owner], ids)
        assert routed.ids_per_shard[1 - owner].size == 0
        np.testing.assert_array_equal(routed.gather(routed.split(ids)), ids)
    with pytest.raises(ValueError, match="outside ranks"):
        Placement(2, np.zeros(4, np.int64), {"C1": 2})


def test_one_rank_collective_equals_local_shard() -> None:
    """Without a process group the collective connection must behave exactly like an in-process shard."""
    batches = make_batches(1, STEPS)
    got = train_collective(0, 1, "row_wise", [batches])
    want = oracle([batches])
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    for table in make_tables():
        np.testing.assert_array_equal(got["rows"][table][0], want["rows"][table][0])
        np.testing.assert_allclose(got["rows"][table][1], want["rows"][table][1], rtol=1e-6, atol=1e-7)


# -- two processes -------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_two_ranks_equal_one_process_with_the_concatenated_batch(sharding: str) -> None:
    batches = [make_batches(10 + rank, STEPS) for rank in range(2)]
    results = run_local_group(train_collective, world_size=2, args=(sharding, batches))
    want = oracle(batches)
    for table in make_tables():
        ids, rows = merge_rows([r["rows"] for r in results], table)
        np.testing.assert_array_equal(ids, want["rows"][table][0])  # every row lives on exactly one rank
        np.testing.assert_allclose(rows, want["rows"][table][1], rtol=1e-5, atol=1e-6, err_msg=table)
    for result in results:
        for key, value in want["dense"].items():
            torch.testing.assert_close(result["dense"][key], value, rtol=1e-5, atol=1e-6)
        assert result["bytes_sent"] > 0
    # the mean of the ranks' losses is the oracle's loss (equal batch sizes)
    np.testing.assert_allclose(np.mean([r["losses"] for r in results], axis=0), want["losses"], rtol=1e-5)
    if sharding == "table_wise":
        owned = [set(r["rows"]) for r in results]
        assert all(r["rows"]["C2"][0].size == 0 for r in results[:1])  # C2 lives on rank 1 only
        assert owned[0] == owned[1]


def test_rank_without_a_batch_still_meets_the_exchanges() -> None:
    """Rank 1 runs out a step early: it runs an empty step, and both ranks finish with equal dense models."""
    batches = [make_batches(20, STEPS), make_batches(21, STEPS - 1)]
    results = run_local_group(train_collective, world_size=2, args=("row_wise", batches))
    assert len(results[0]["losses"]) == len(results[1]["losses"]) == STEPS
    assert np.isnan(results[1]["losses"][-1])
    for key, value in results[0]["dense"].items():
        torch.testing.assert_close(results[1]["dense"][key], value)


def test_batch_norm_running_statistics_are_averaged_across_ranks() -> None:
    """Each rank's forward updates its batch norm from its own batch; the step averages them, so the
    replicas evaluate with the same statistics (and every dense tensor stays identical)."""
    batches = [make_batches(30 + rank, STEPS) for rank in range(2)]
    results = run_local_group(train_collective, world_size=2, args=("row_wise", batches, True))
    alone = train_collective(0, 1, "row_wise", [batches[0]], True)
    means = [key for key in results[0]["dense"] if key.endswith("running_mean")]
    assert means
    for key, value in results[0]["dense"].items():
        torch.testing.assert_close(results[1]["dense"][key], value)
    assert not torch.allclose(results[0]["dense"][means[0]], alone["dense"][means[0]])
