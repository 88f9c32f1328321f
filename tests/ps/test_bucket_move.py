"""Bucket moves between live shards, without Ray: the move plan, and the copy -> switch -> drop
protocol against an oracle that never moved anything (one shard holding every row, fed the same
pulls and pushes): rows, optimizer state, counts and snapshots equal bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from psrec.embedding import AdmissionSpec, EmbeddingTable, InitializerSpec, SparseOptimizerSpec
from psrec.ps.bucket_move import (
    MoveError,
    add_bucket_rows,
    apply_round,
    balanced_map,
    bucket_rows,
    check_shard_count,
    drop_buckets,
    move_rounds,
    start_at,
    target_counts,
)
from psrec.ps.client import EmbeddingClient, LocalConnection, RoutedIds
from psrec.ps.routing import bucket_of, default_bucket_map
from psrec.ps.shard import ParameterShard

DIM = 4
BUCKETS = 64


# -- the plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (2, 4), (4, 2), (1, 7), (5, 5), (3, 64)])
def test_the_balanced_map_moves_only_the_excess_buckets(old: int, new: int) -> None:
    old_map = default_bucket_map(BUCKETS, old)
    new_map = balanced_map(old_map, new)
    targets = target_counts(BUCKETS, new)
    np.testing.assert_array_equal(np.bincount(new_map, minlength=new), targets)
    assert new_map.max() == new - 1
    # the fewest moves: what each old shard holds beyond its target (all of it beyond the new count)
    held = np.bincount(old_map, minlength=old)
    excess = sum(max(0, int(held[s]) - (int(targets[s]) if s < new else 0)) for s in range(old))
    assert int(np.count_nonzero(old_map != new_map)) == excess
    rounds = move_rounds(old_map, new_map, max_buckets=5)
    assert all(sum(len(m.buckets) for m in r) <= 5 for r in rounds)
    current = old_map
    for moves in rounds:
        current = apply_round(current, moves)
    np.testing.assert_array_equal(current, new_map)


def test_a_round_whose_source_does_not_own_its_buckets_is_refused() -> None:
    old_map = default_bucket_map(BUCKETS, 2)
    (first, *_), *_ = move_rounds(old_map, balanced_map(old_map, 3), max_buckets=4)
    with pytest.raises(MoveError, match="are not on shard"):
        apply_round(balanced_map(old_map, 3), [first])


@pytest.mark.parametrize("count", [0, -1, BUCKETS + 1, 2.5, "3", True])
def test_a_shard_count_outside_1_to_the_bucket_count_is_refused(count: object) -> None:
    with pytest.raises(MoveError, match="shard count must be"):
        check_shard_count(count, BUCKETS)


# -- the protocol ----------------------------------------------------------------------------------
def make_tables(admission: AdmissionSpec = AdmissionSpec()) -> dict[str, EmbeddingTable]:  # noqa: B008
    return {
        name: EmbeddingTable(
            name,
            DIM,
            optimizer=SparseOptimizerSpec("adagrad", lr=0.3),
            initializer=InitializerSpec("uniform", scale=0.1),
            admission=admission,
        )
        for name in ("t", "u")
    }


def make_client(shards: list[ParameterShard], bucket_map: np.ndarray) -> EmbeddingClient:
    connections = [LocalConnection(shard) for shard in shards]
    return EmbeddingClient(connections, bucket_map, table_dims={"t": DIM, "u": DIM})  # type: ignore[arg-type]


def train_step(client: EmbeddingClient, routing: RoutedIds, step: int) -> None:
    """Pull, then push a gradient that is a function of each row (and so of the id and the past)."""
    pulled = client.pull(routing)
    grads = {
        name: np.sin(rows * 3.0 + routing.unique_ids[name][:, None] + step).astype(np.float32)
        for name, rows in pulled.rows.items()
    }
    client.push(routing, grads.get, step=step)


def route(client: EmbeddingClient, ids: np.ndarray) -> RoutedIds:
    half = ids.size // 2
    routing, _, _ = client.route(ids, table_starts=np.array([0, half, ids.size]), tables=["t", "u"])
    return routing


def everything(shards: list[ParameterShard]) -> dict[str, dict[str, np.ndarray]]:
    """Every table's full state across `shards`, merged and sorted by id (counts, optimizer state...)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in ("t", "u"):
        states = [shard.tables[name].export_state() for shard in shards]
        ids = np.concatenate([s.ids for s in states])
        order = np.argsort(ids)
        assert np.unique(ids).size == ids.size, "an id lives on two shards"
        out[name] = {
            "ids": ids[order],
            "rows": np.concatenate([s.rows for s in states])[order],
            "counts": np.concatenate([s.counts for s in states])[order],
            "last_step": np.concatenate([s.last_step for s in states])[order],
            **{
                key: np.concatenate([s.optimizer_state[key] for s in states])[order]
                for key in states[0].optimizer_state
            },
        }
    return out


def assert_same(got: dict[str, dict[str, np.ndarray]], expected: dict[str, dict[str, np.ndarray]]) -> None:
    for name, fields in expected.items():
        for key, value in fields.items():
            np.testing.assert_array_equal(got[name][key], value, err_msg=f"{name}/{key}")


def reshard(shards: list[ParameterShard], bucket_map: np.ndarray, count: int, step: int) -> np.ndarray:
    """Move `shards` (grown in place) to `count` shards, one round of 7 buckets after another."""
    for index in range(len(shards), count):
        shards.append(ParameterShard(index, make_tables(), num_trainers=1))
        start_at(shards[-1], step)
    for moves in move_rounds(bucket_map, balanced_map(bucket_map, count), max_buckets=7):
        for move in moves:
            arrays = bucket_rows(shards[move.source], move.buckets, BUCKETS)
            add_bucket_rows(shards[move.destination], arrays, num_buckets=BUCKETS)
        bucket_map = apply_round(bucket_map, moves)
        for move in moves:
            drop_buckets(shards[move.source], move.buckets, BUCKETS)
    del shards[count:]
    return bucket_map


def test_training_across_moves_2_to_3_to_1_equals_a_shard_that_never_moved() -> None:
    rng_ids = np.random.default_rng(0)
    batches = [rng_ids.integers(0, 400, size=60).astype(np.int64) for _ in range(30)]
    oracle = [ParameterShard(0, make_tables(), num_trainers=1)]
    oracle_client = make_client(oracle, default_bucket_map(BUCKETS, 1))
    shards = [ParameterShard(i, make_tables(), num_trainers=1) for i in range(2)]
    bucket_map = default_bucket_map(BUCKETS, 2)
    client = make_client(shards, bucket_map)
    stale = None
    for step, ids in enumerate(batches):
        if step in (10, 20):  # between steps: a move, then every trainer switches its map
            if step == 10:
                oracle[0].save_snapshot("best")
                for shard in shards:
                    shard.save_snapshot("best")
            stale = route(client, batches[step])  # routed ahead with the old map (the planner)
            count = 3 if step == 10 else 1
            bucket_map = reshard(shards, bucket_map, count, step)
            client.set_routing(
                [LocalConnection(s) for s in shards], bucket_map, version=client.routing_version + 1
            )
            assert sum(s.tables["t"].num_rows for s in shards) == oracle[0].tables["t"].num_rows
        routing = stale if stale is not None else route(client, ids)
        stale = None
        train_step(oracle_client, route(oracle_client, ids), step)
        train_step(client, routing, step)
        # every row lives on the shard the current map names
        for shard in shards:
            ids_here = shard.tables["t"].export_state().ids
            assert np.all(bucket_map[bucket_of(ids_here, BUCKETS)] == shard.shard_index)
    assert_same(everything(shards), everything(oracle))
    # the snapshot taken on 2 shards moved with its buckets
    oracle[0].restore_snapshot("best")
    for shard in shards:
        shard.restore_snapshot("best")
    assert_same(everything(shards), everything(oracle))
    assert all(shard.needs_full_checkpoint for shard in shards)


def test_a_min_count_sketch_moves_summed_and_admits_no_later() -> None:
    admission = AdmissionSpec("min_count", min_count=2, sketch_depth=2, sketch_width=1 << 14)
    source = ParameterShard(0, make_tables(admission), num_trainers=1)
    destination = ParameterShard(1, make_tables(admission), num_trainers=1)
    ids = np.arange(40, dtype=np.int64)
    source.pull({"t": ids})  # counted once each: none admitted yet
    destination.pull({"t": ids + 1000})
    before = [s.tables["t"].export_state().admission_sketch for s in (source, destination)]
    add_bucket_rows(destination, bucket_rows(source, list(range(BUCKETS)), BUCKETS), num_buckets=BUCKETS)
    after = destination.tables["t"].export_state().admission_sketch
    np.testing.assert_array_equal(after, before[0] + before[1])  # type: ignore[operator]
    destination.pull({"t": ids})  # the second occurrence of each: admitted on the destination
    assert set(ids.tolist()) <= set(destination.tables["t"].export_state().ids.tolist())


def test_a_move_in_the_middle_of_a_sync_step_is_refused_and_changes_nothing() -> None:
    shard = ParameterShard(0, make_tables(), num_trainers=2)
    ids = np.arange(10, dtype=np.int64)
    shard.pull({"t": ids})
    shard.push(0, 0, 0, {"t": (ids, np.ones((10, DIM), np.float32))})  # trainer 1 has not pushed
    with pytest.raises(MoveError, match="middle of step 0"):
        drop_buckets(shard, list(range(BUCKETS)), BUCKETS)
    assert shard.tables["t"].num_rows == 10
