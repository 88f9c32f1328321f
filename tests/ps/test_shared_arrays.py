"""Shared-memory arrays between a trainer and its shards (`psrec.ps.shared_arrays`), and the Ray
connection that uses them: the same rows as through Ray's object store, segments never overwritten
while a call or an array still needs them, and a shard that cannot open them served the arrays
themselves, in order.

Run: `python -m pytest tests/ps/test_shared_arrays.py -q` (the Ray tests start a local cluster).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from psrec.ps import shared_arrays
from psrec.ps.shared_arrays import (
    SHM_DIRECTORY,
    SegmentPool,
    SharedArrays,
    SharedMemoryUnavailable,
    unlink_job_segments,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIRECTORY), reason="no /dev/shm on this machine")


def _segments(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIRECTORY) if name.startswith(prefix))


def test_arrays_written_are_loaded_as_copies_of_themselves() -> None:
    pool = SegmentPool()
    rng = np.random.default_rng(0)
    arrays = {
        "ids": rng.integers(-(2**62), 2**62, 1001),
        "grads": rng.normal(size=(1001, 7)).astype(np.float32),
    }
    message = pool.write(arrays)
    assert message is not None and message.arrays is not None
    loaded = message.arrays.load()
    for key, array in arrays.items():
        assert loaded[key].dtype == array.dtype and loaded[key].shape == array.shape
        np.testing.assert_array_equal(loaded[key], array)
    pool.release(message)
    again = pool.write({"ids": np.zeros(1001, np.int64), "grads": np.zeros((1001, 7), np.float32)})
    assert again is not None and again.segment is message.segment  # reused once released
    np.testing.assert_array_equal(loaded["ids"], arrays["ids"])  # the copy kept its values
    pool.close()


def test_a_segment_is_not_reused_while_its_call_or_an_array_on_it_lives() -> None:
    pool = SegmentPool()
    first = pool.reserve(4096)
    assert first is not None and first.reply is not None
    written = first.reply.write({"rows": np.full((8, 4), 7.0, np.float32)})
    assert written is not None
    second = pool.reserve(4096)
    assert second is not None and second.segment is not first.segment  # the first call is unanswered
    pool.release(first)
    rows = pool.read(first, written)["rows"]
    held = rows[2:4]  # a view of the view: still the segment's bytes
    del rows
    third = pool.reserve(4096)
    assert third is not None and third.segment is not first.segment  # `held` still reads it
    assert third.reply is not None
    third.reply.write({"rows": np.zeros((8, 4), np.float32)})
    np.testing.assert_array_equal(held, np.full((2, 4), 7.0, np.float32))
    del held
    pool.release(third)
    assert pool.reserve(4096).segment is first.segment  # type: ignore[union-attr]
    pool.close()


def test_rows_that_do_not_fit_their_space_are_not_written() -> None:
    pool = SegmentPool()
    message = pool.reserve(100)
    assert message is not None and message.reply is not None
    too_many = np.zeros((message.reply.capacity // 4 + 1,), np.float32)
    assert message.reply.write({"rows": too_many}) is None
    pool.close()


def test_no_segment_is_made_without_room_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_arrays, "_FREE_SHARE", 0.0)
    pool = SegmentPool()
    assert pool.write({"ids": np.arange(10)}) is None and pool.reserve(10) is None
    assert _segments(pool.prefix) == []


def test_segments_are_unlinked_on_close_and_a_jobs_leftovers_by_the_driver() -> None:
    pool = SegmentPool(shared_arrays.job_prefix("testjob") + "a")
    other = SegmentPool(shared_arrays.job_prefix("otherjob") + "b")
    for each in (pool, other):
        assert each.write({"ids": np.arange(100)}) is not None and each.reserve(1 << 21) is not None
    assert len(_segments(pool.prefix)) == 2
    pool.close()
    assert _segments(pool.prefix) == []
    leftover = SegmentPool(shared_arrays.job_prefix("testjob") + "c")
    leftover.write({"ids": np.arange(100)})
    leftover._finalizer.detach()  # as a killed trainer leaves it
    assert unlink_job_segments("testjob") == 1
    assert _segments(shared_arrays.job_prefix("testjob")) == []
    assert len(_segments(other.prefix)) == 2  # another job's are left alone
    other.close()


def test_a_segment_that_is_not_on_this_machine_is_a_clear_error() -> None:
    missing = SharedArrays("psrec-nojob-never-made", {"ids": (0, (3,), "<i8")})
    with pytest.raises(SharedMemoryUnavailable, match="psrec-nojob-never-made"):
        missing.load()


# -- through Ray ----------------------------------------------------------------------------------
DIM = 8


def _shard(ray: Any) -> Any:
    from psrec.embedding import InitializerSpec, SparseOptimizerSpec, TableSpec
    from psrec.ps.actors import ShardActor

    specs = [
        TableSpec(name, DIM, SparseOptimizerSpec("adagrad", lr=0.2), InitializerSpec("uniform", 0.1))
        for name in ("t", "u")
    ]
    return ray.remote(ShardActor).options(num_cpus=0).remote(0, specs, num_trainers=1, mode="sync")


def _steps(connection: Any) -> list[dict[str, np.ndarray]]:
    """Pull, push, pull, ... on one connection; the rows of every pull."""
    rng = np.random.default_rng(3)
    seen = []
    for step in range(4):
        ids = {"t": np.unique(rng.integers(0, 5000, 3000)), "u": np.unique(rng.integers(0, 50, 40))}
        pulled = connection.pull(ids, train=True, request=step + 1)
        rows = {name: np.array(values) for name, values in pulled.result().items()}
        for name, values in pulled.result().items():  # asked again: the same rows
            np.testing.assert_array_equal(values, rows[name])
        seen.append(rows)
        grads = {name: (ids[name], rng.normal(size=(ids[name].size, DIM)).astype(np.float32)) for name in ids}
        assert connection.push(0, step, step, grads).result()
    return seen


@pytest.mark.ray
def test_a_shard_on_this_machine_gets_arrays_through_shared_memory_with_the_same_rows(
    ray_cluster: None,
) -> None:
    """Bit for bit the rows of the same calls through Ray's object store, on a twin shard."""
    import ray

    from psrec.ps.actors import RayConnection

    shared = RayConnection(_shard(ray), caller="trainer-0")
    plain = RayConnection(_shard(ray), caller="trainer-0", shared_memory=False)
    through_memory, through_ray = _steps(shared), _steps(plain)
    assert shared._same_machine is True and shared.pool is not None and shared.pool.segment_names
    for got, expected in zip(through_memory, through_ray, strict=True):
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
    names = shared.pool.segment_names
    shared.close()
    assert not any(os.path.exists(os.path.join(SHM_DIRECTORY, name)) for name in names)


@pytest.mark.ray
def test_a_shard_that_cannot_open_the_segments_gets_the_arrays_in_the_same_order(
    ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments the shard cannot open (as on another machine): the push and the pull sent after it
    are sent again with their arrays, the push first, even when the pull's answer is asked first;
    then nothing goes through shared memory."""
    import ray

    from psrec.ps.actors import RayConnection

    connection = RayConnection(_shard(ray), caller="trainer-0")
    oracle = RayConnection(_shard(ray), caller="trainer-0", shared_memory=False)
    pool = connection.pool
    assert pool is not None
    real_write = pool.write

    def elsewhere(arrays: dict[str, np.ndarray]) -> Any:
        message = real_write(arrays)
        assert message is not None and message.arrays is not None
        message.arrays = SharedArrays("psrec-nojob-elsewhere", message.arrays.layout)
        return message

    monkeypatch.setattr(pool, "write", elsewhere)
    ids = {"t": np.arange(0, 300, 3), "u": np.arange(10)}
    grads = {name: (ids[name], np.ones((ids[name].size, DIM), np.float32)) for name in ids}
    for each in (connection, oracle):
        each.pull(ids, train=True, request=1)
        each.push(0, 0, 0, grads)
    pulled = connection.pull(ids, train=True, request=2)
    rows = pulled.result()  # asked before the push's answer
    expected = oracle.pull(ids, train=True, request=2).result()
    for name in ids:
        np.testing.assert_array_equal(rows[name], expected[name])
    assert connection._same_machine is False
    assert connection.pull(ids, train=False).result()["t"].shape == (ids["t"].size, DIM)
    connection.close()
