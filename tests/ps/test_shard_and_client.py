"""The PS protocol without Ray: a shard's sync/async steps and idempotence, and the arrays-only client
(route -> pull -> push over 1-3 shards) against a NumPy oracle."""

import numpy as np
import pytest

from psrec.embedding import EmbeddingTable, InitializerSpec, SparseOptimizerSpec
from psrec.ps.client import EmbeddingClient, LocalConnection
from psrec.ps.routing import bucket_of, default_bucket_map
from psrec.ps.shard import ParameterShard

DIM = 4


def make_table(name: str = "t", lr: float = 0.5) -> EmbeddingTable:
    return EmbeddingTable(
        name,
        DIM,
        optimizer=SparseOptimizerSpec("sgd", lr=lr),
        initializer=InitializerSpec("uniform", scale=0.1),
    )


def make_shards(num_shards: int, *, num_trainers: int = 1, mode: str = "sync") -> list[ParameterShard]:
    return [
        ParameterShard(i, {"t": make_table(), "u": make_table("u")}, num_trainers=num_trainers, mode=mode)
        for i in range(num_shards)
    ]


def test_sync_shard_applies_a_step_once_all_trainers_pushed() -> None:
    (shard,) = make_shards(1, num_trainers=2)
    ids = np.array([1, 2], dtype=np.int64)
    before = shard.pull({"t": ids})["t"].copy()
    grads = np.ones((2, DIM), dtype=np.float32)
    assert shard.push(0, 0, 0, {"t": (ids, grads)})
    np.testing.assert_array_equal(shard.pull({"t": ids})["t"], before)  # buffered, not applied
    assert shard.push(1, 0, 0, {"t": (ids[:1], grads[:1])})
    after = shard.pull({"t": ids})["t"]
    np.testing.assert_allclose(after, before - 0.5 * np.array([[2.0] * DIM, [1.0] * DIM]), rtol=1e-6)
    assert shard.applied_step == 0


def test_a_sync_shard_told_another_trainer_count_completes_steps_with_that_many() -> None:
    """2 trainers, then 3 (trainers added between steps), then 1: a step is applied once that many
    trainers pushed it (plain SGD arithmetic as the oracle); a change inside a step is refused."""
    (shard,) = make_shards(1, num_trainers=2)
    ids = np.array([3], dtype=np.int64)
    expected = shard.pull({"t": ids})["t"].copy()
    grads = np.ones((1, DIM), dtype=np.float32)
    for step, trainers in enumerate((2, 3, 1)):
        shard.set_num_trainers(trainers)
        for trainer in range(trainers):
            np.testing.assert_allclose(shard.pull({"t": ids})["t"], expected, rtol=1e-6)  # not applied yet
            shard.push(trainer, step, step, {"t": (ids, grads)})
        expected = expected - 0.5 * trainers
        np.testing.assert_allclose(shard.pull({"t": ids})["t"], expected, rtol=1e-6)
        assert shard.applied_step == step
    with pytest.raises(ValueError, match="num_trainers must be an integer >= 1, got 0"):
        shard.set_num_trainers(0)
    shard.set_num_trainers(2)
    shard.push(0, 3, 3, {"t": (ids, grads)})
    with pytest.raises(RuntimeError, match="in the middle of step 3"):
        shard.set_num_trainers(1)


def test_push_retry_is_applied_once() -> None:
    (shard,) = make_shards(1, mode="async")
    ids = np.array([5], dtype=np.int64)
    before = shard.pull({"t": ids})["t"].copy()
    grads = np.ones((1, DIM), dtype=np.float32)
    assert shard.push(0, 7, 7, {"t": (ids, grads)})
    assert not shard.push(0, 7, 7, {"t": (ids, grads)})  # retried after a "crash"
    np.testing.assert_allclose(shard.pull({"t": ids})["t"], before - 0.5, rtol=1e-6)
    assert shard.pushes_dropped == 1


def test_unknown_table_is_a_clear_error_and_changes_nothing() -> None:
    (shard,) = make_shards(1)
    with pytest.raises(KeyError, match="no table 'nope'"):
        shard.push(0, 0, 0, {"nope": (np.array([1]), np.ones((1, DIM), np.float32))})
    assert shard.last_request == {}


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_client_routes_pulls_and_pushes_arrays_like_one_table(num_shards: int) -> None:
    """Two tables' ids (with repeats) routed to their shards, pulled back in order, and pushed: the
    rows and the update equal one unsharded table's (SGD: row -= lr * summed gradient)."""
    shards = make_shards(num_shards)
    bucket_map = default_bucket_map(16, num_shards)
    client = EmbeddingClient(
        [LocalConnection(s) for s in shards], bucket_map, table_dims={"t": DIM, "u": DIM}
    )
    rng = np.random.default_rng(0)
    ids = {"t": rng.integers(-50, 50, 40), "u": rng.integers(0, 10, 25)}
    all_ids = np.concatenate([ids["t"], ids["u"]]).astype(np.int64)
    table_starts = np.array([0, 40, 65], dtype=np.int64)
    routing, inverse, starts = client.route(all_ids, table_starts=table_starts, tables=["t", "u"])
    oracle = {name: make_table(name) for name in ("t", "u")}
    for t, name in enumerate(("t", "u")):
        unique = routing.unique_ids[name]
        assert sorted(unique.tolist()) == sorted(set(ids[name].tolist()))
        owners = bucket_map[bucket_of(unique, 16)]
        assert (np.diff(owners) >= 0).all()  # grouped by owning shard
        positions = inverse[table_starts[t] : table_starts[t + 1]] - starts[t]  # into the table's own
        np.testing.assert_array_equal(unique[positions], ids[name])
    pulled = client.pull(routing)
    for name in ("t", "u"):
        np.testing.assert_array_equal(pulled.rows[name], oracle[name].pull(routing.unique_ids[name]))
    grads = {
        name: rng.normal(size=(routing.unique_ids[name].size, DIM)).astype(np.float32) for name in ("t", "u")
    }
    client.push(routing, grads.get, step=0, scale=0.5)
    for name in ("t", "u"):
        oracle[name].push(routing.unique_ids[name], grads[name] * np.float32(0.5), step=0)
        after = client.pull(routing, train=False).rows[name]
        np.testing.assert_allclose(after, oracle[name].pull(routing.unique_ids[name], train=False), rtol=1e-6)
    assert client.bytes_pulled > 0 and client.bytes_pushed > 0


def test_a_table_without_gradients_pushes_zeros_and_every_shard_gets_the_push() -> None:
    shards = make_shards(2, num_trainers=1)
    client = EmbeddingClient(
        [LocalConnection(s) for s in shards], default_bucket_map(8, 2), table_dims={"t": DIM, "u": DIM}
    )
    ids = np.arange(10, dtype=np.int64)
    routing, _, _ = client.route(ids, table_starts=np.array([0, 10], dtype=np.int64), tables=["t"])
    before = client.pull(routing).rows["t"].copy()
    client.push(routing, lambda name: None, step=0)
    np.testing.assert_array_equal(client.pull(routing, train=False).rows["t"], before)
    assert [s.applied_step for s in shards] == [0, 0]
    client.push(routing, lambda name: None, step=0)  # a retry of the same step: dropped everywhere
    assert [s.pushes_dropped for s in shards] == [1, 1]


def test_shard_prefetches_only_disk_tier_tables_whose_pulls_promote_enough(tmp_path):
    """`ParameterShard.prefetch` reads ahead in a TieredTable whose last training pull promoted at
    least its prefetch_min_rows rows, not in one below it nor in an in-memory table; a prefetched
    pull returns the rows of a pull without it."""
    from psrec.embedding import EmbeddingTable, SparseOptimizerSpec, TieredTable
    from psrec.ps import shard as shard_module

    optimizer = SparseOptimizerSpec("sgd", lr=0.1)
    tiered = {"memory_rows": 20, "disk_dir": str(tmp_path), "optimizer": optimizer, "prefetch_min_rows": 50}
    tables = {
        "big": TieredTable("big", 4, **tiered),
        "small": TieredTable("small", 4, **tiered),
        "plain": EmbeddingTable("plain", 4, optimizer=optimizer),
    }
    oracle = TieredTable("big", 4, memory_rows=20, disk_dir=str(tmp_path), optimizer=optimizer)
    shard = shard_module.ParameterShard(0, tables)
    many, few = np.arange(200, dtype=np.int64), np.arange(30, dtype=np.int64)
    for step in (1, 2):  # the second pull promotes what the first push demoted
        shard.pull({"big": many, "small": few, "plain": few})
        oracle.pull(many)
        for table, ids in ((tables["big"], many), (tables["small"], few), (oracle, many)):
            table.push(ids, np.ones((ids.shape[0], 4), np.float32), step=step)
    assert tables["big"].last_promotions >= 50 > tables["small"].last_promotions
    assert shard.prefetch({"big": many, "small": few, "plain": few}) > 0
    assert tables["small"]._cold._prefetch is None
    assert shard.pull({"big": many})["big"].tobytes() == oracle.pull(many).tobytes()
    assert tables["big"].tier_stats()["prefetch_hits"] > 0


class _RecordingConnection(LocalConnection):
    """An in-process connection that records what it is told to prefetch."""

    def __init__(self, shard: ParameterShard) -> None:
        super().__init__(shard)
        self.prefetched: list[dict[str, np.ndarray]] = []

    def prefetch(self, requests: dict[str, np.ndarray]) -> int:
        self.prefetched.append({name: ids.copy() for name, ids in requests.items()})
        return super().prefetch(requests)


class _NoPrefetch:
    """A connection without `prefetch` (as a pipeline stage's): never told."""

    def __init__(self, shard: ParameterShard) -> None:
        self.inner = LocalConnection(shard)

    def pull(self, requests, *, train, request=None):
        return self.inner.pull(requests, train=train, request=request)

    def push(self, trainer, request_id, step, gradients):
        return self.inner.push(trainer, request_id, step, gradients)


def test_client_tells_each_shard_its_ids_of_the_disk_tier_tables_only() -> None:
    """`EmbeddingClient.prefetch` sends each shard the ids it owns of the `prefetch_tables` alone
    (the routing's ids, every one to exactly its owner), nothing without such tables (a run with no
    disk tier pays no call), and skips connections that cannot prefetch."""
    shards = make_shards(3)
    recording = [_RecordingConnection(shards[0]), _RecordingConnection(shards[1])]
    connections = [*recording, _NoPrefetch(shards[2])]
    bucket_map = default_bucket_map(16, 3)
    ids = np.arange(0, 300, 7, dtype=np.int64)
    starts = np.array([0, ids.size, 2 * ids.size], dtype=np.int64)
    quiet = EmbeddingClient(connections, bucket_map, table_dims={"t": DIM, "u": DIM})
    routing, _, _ = quiet.route(np.concatenate([ids, ids]), table_starts=starts, tables=["t", "u"])
    assert quiet.prefetch(routing) == 0
    assert all(not connection.prefetched for connection in recording)

    client = EmbeddingClient(connections, bucket_map, table_dims={"t": DIM, "u": DIM}, prefetch_tables=["u"])
    client.prefetch(routing)
    owners = bucket_map[bucket_of(ids, 16)]
    for shard, connection in enumerate(recording):
        (told,) = connection.prefetched
        assert list(told) == ["u"]
        np.testing.assert_array_equal(np.sort(told["u"]), np.sort(ids[owners == shard]))


def test_fused_pulls_still_held_keep_their_rows_through_later_pulls() -> None:
    """Each fused pull's buffer comes from arrays of earlier pulls once those are released
    (psrec.allocator.ReusableBuffers): rows a caller still holds keep their values."""
    dim, batch = 64, 4096  # 4096 x 2 x 64 float32 rows: above the reuse threshold
    tables = {
        name: EmbeddingTable(
            name, dim, optimizer=SparseOptimizerSpec("sgd", lr=0.5), initializer=InitializerSpec("uniform")
        )
        for name in ("t", "u")
    }
    shard = ParameterShard(0, tables, num_trainers=1, mode="sync")
    client = EmbeddingClient(
        [LocalConnection(shard)], default_bucket_map(16, 1), table_dims={"t": dim, "u": dim}
    )
    rng = np.random.default_rng(1)
    held, copies = [], []
    for step in range(4):
        ids = rng.integers(step * 10**6, (step + 1) * 10**6, size=2 * batch).astype(np.int64)
        routing, _, _ = client.route(
            ids,
            table_starts=np.array([0, batch, 2 * batch]),
            tables=["t", "u"],
            sample_major=(batch, np.arange(2)),
        )
        pulled = client.pull(routing)
        assert pulled.fused["rows"].nbytes >= 1 << 20
        if step % 2 == 0:
            held.append(pulled)
            copies.append({name: rows.copy() for name, rows in pulled.rows.items()})
    for pulled, copy in zip(held, copies, strict=True):
        for name, rows in copy.items():
            np.testing.assert_array_equal(pulled.rows[name], rows)
    assert client._fused_buffers.reused >= 1  # the released pulls' arrays were used again
