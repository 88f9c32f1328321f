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


# -- a shard actor's reads and replies, in this process --------------------------------------------
DIM = 8


def _specs() -> list[Any]:
    from psrec.embedding import InitializerSpec, SparseOptimizerSpec, TableSpec

    return [
        TableSpec(name, DIM, SparseOptimizerSpec("adagrad", lr=0.2), InitializerSpec("uniform", 0.1))
        for name in ("t", "u")
    ]


def _local_shard(**options: Any) -> Any:
    from psrec.ps.actors import ShardActor

    return ShardActor(0, _specs(), **{"num_trainers": 1, "mode": "sync", **options})


def _shared_push(pool: SegmentPool, gradients: dict[str, tuple[np.ndarray, np.ndarray]]) -> Any:
    from psrec.ps.actors import SharedGradients

    tables = list(gradients)
    arrays = {}
    for i, name in enumerate(tables):
        arrays[f"{i}/ids"], arrays[f"{i}/grads"] = gradients[name]
    message = pool.write(arrays)
    assert message is not None and message.arrays is not None
    return message, SharedGradients(tables, message.arrays)


def _shared_pull(pool: SegmentPool, requests: dict[str, np.ndarray]) -> Any:
    from psrec.ps.actors import SharedRequest

    tables = list(requests)
    sent = pool.write({str(i): requests[name] for i, name in enumerate(tables)})
    reply = pool.reserve(1 << 20)
    assert sent is not None and sent.arrays is not None and reply is not None and reply.reply is not None
    return (sent, reply), SharedRequest(tables, sent.arrays, reply.reply)


def _rows(pool: SegmentPool, reply: Any, answer: Any) -> dict[str, np.ndarray]:
    if isinstance(answer, SharedArrays):
        return {name: np.array(rows) for name, rows in pool.read(reply, answer).items()}
    return {name: np.array(rows) for name, rows in answer.items()}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_the_shard_holds_is_copied_and_one_it_applies_is_read_in_place(mode: str) -> None:
    """Two trainers: a sync shard holds trainer 0's push until trainer 1's comes, so what it holds
    must survive the trainer reusing the segment; the rows match a twin shard sent plain arrays."""
    rng = np.random.default_rng(5)
    shared, plain = _local_shard(num_trainers=2, mode=mode), _local_shard(num_trainers=2, mode=mode)
    assert shared.shard.applies_pushes_at_once is (mode == "async")
    pool = SegmentPool()
    ids = {"t": np.arange(0, 900, 3), "u": np.arange(20)}
    for shard in (shared, plain):
        shard.pull(ids, True)  # rows are made by a training pull (a push to an absent id is dropped)
    for step in range(2):
        for trainer in range(2):
            grads = {
                name: (ids[name], rng.normal(size=(ids[name].size, DIM)).astype(np.float32)) for name in ids
            }
            message, gradients = _shared_push(pool, grads)
            assert shared.push(trainer, step, step, gradients)
            pool.release(message)
            garbage = pool.write({key: np.full_like(a, 99) for key, a in message.arrays.load().items()})
            assert garbage is not None and garbage.segment is message.segment  # the trainer reuses it
            pool.release(garbage)
            assert plain.push(trainer, step, step, grads)
    for name in ids:
        np.testing.assert_array_equal(
            shared.pull({name: ids[name]}, train=False)[name],
            plain.pull({name: ids[name]}, train=False)[name],
        )
    pool.close()


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_an_unlogged_shard_answers_a_shared_pull_in_its_reply_segment(wire: str) -> None:
    rng = np.random.default_rng(6)
    shared, plain = _local_shard(wire_precision=wire), _local_shard(wire_precision=wire)
    pool = SegmentPool()
    for _ in range(3):
        ids = {"t": np.unique(rng.integers(0, 5000, 700)), "u": np.unique(rng.integers(0, 50, 30))}
        (sent, reply), request = _shared_pull(pool, ids)
        answer = shared.pull(request, True)
        assert isinstance(answer, SharedArrays) and answer.segment == reply.reply.segment
        rows = _rows(pool, reply, answer)
        expected = plain.pull(ids, True)
        for name in ids:
            assert rows[name].dtype == expected[name].dtype
            np.testing.assert_array_equal(rows[name], expected[name])
        pool.release(sent)
        pool.release(reply)
    pool.close()


def test_a_logged_shard_answers_a_pull_sent_again_with_its_first_rows_after_the_segments_are_reused(
    tmp_path: Any,
) -> None:
    """A logged shard keeps its replies (a pull sent again after a failure gets the same rows): what
    it keeps is its own, not the trainer's segments, which the trainer reuses once answered."""
    from psrec.ps.replay import prepare_fresh

    prepare_fresh(tmp_path / "log")
    shard = _local_shard(push_log=str(tmp_path / "log"))
    pool = SegmentPool()
    ids = {"t": np.arange(0, 600, 2), "u": np.arange(25)}
    (sent, reply), request = _shared_pull(pool, ids)
    first = _rows(pool, reply, shard.pull(request, True, "trainer-0", 1))
    for message in (sent, reply):
        pool.release(message)
    grads = {name: (ids[name], np.ones((ids[name].size, DIM), np.float32)) for name in ids}
    message, gradients = _shared_push(pool, grads)
    assert shard.push(0, 0, 0, gradients)
    garbage = pool.write({str(i): np.full_like(ids[name], -1) for i, name in enumerate(ids)})
    assert garbage is not None and {message.segment, garbage.segment} == {sent.segment, reply.segment}
    (sent, reply), request = _shared_pull(pool, ids)  # sent again, through other segments
    again = _rows(pool, reply, shard.pull(request, True, "trainer-0", 1))
    for name in ids:
        np.testing.assert_array_equal(again[name], first[name])
    assert not np.array_equal(shard.pull(ids, False)["t"], first["t"])  # the push did change them
    pool.close()


# -- through Ray ----------------------------------------------------------------------------------
def _shard(ray: Any) -> Any:
    from psrec.ps.actors import ShardActor

    return ray.remote(ShardActor).options(num_cpus=0).remote(0, _specs(), num_trainers=1, mode="sync")


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
