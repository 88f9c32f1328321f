"""A shard's opt-in row versions (`ParameterShard.record_versions`): what counts as one update and
what a training pull logs."""

import numpy as np
import pytest

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.ps.shard import ParameterShard

DIM = 2


def make_shard(*, num_trainers: int = 1, mode: str = "sync") -> ParameterShard:
    table = EmbeddingTable("t", DIM, optimizer=SparseOptimizerSpec("sgd", lr=0.1))
    return ParameterShard(0, {"t": table}, num_trainers=num_trainers, mode=mode)


def grads(count: int) -> np.ndarray:
    return np.ones((count, DIM), dtype=np.float32)


def versions_read(shard: ParameterShard, ids: list[int]) -> list[int]:
    shard.pull({"t": np.array(ids, dtype=np.int64)})
    read_ids, versions = shard.version_log()[-1]["t"]
    assert read_ids.tolist() == ids
    return versions.tolist()


def test_a_sync_step_of_two_trainers_is_one_update_of_each_row() -> None:
    shard = make_shard(num_trainers=2)
    shard.record_versions()
    ids = np.array([1, 2], dtype=np.int64)
    assert versions_read(shard, [1, 2, 3]) == [0, 0, 0]
    shard.push(0, 0, 0, {"t": (ids, grads(2))})
    assert versions_read(shard, [1, 2]) == [0, 0]  # buffered, not applied
    shard.push(1, 0, 0, {"t": (ids[:1], grads(1))})
    assert versions_read(shard, [2, 1, 3]) == [1, 1, 0]


def test_async_pushes_count_each_retries_none_and_evaluation_pulls_are_not_logged() -> None:
    shard = make_shard(num_trainers=2, mode="async")
    with pytest.raises(RuntimeError, match="record_versions"):
        shard.version_log()
    shard.record_versions()
    assert versions_read(shard, [4]) == [0]
    ids = np.array([4], dtype=np.int64)
    shard.push(0, 0, 0, {"t": (ids, grads(1))})
    shard.push(1, 0, 0, {"t": (ids, grads(1))})
    assert not shard.push(1, 0, 0, {"t": (ids, grads(1))})  # a retry changes no row
    shard.pull({"t": ids}, train=False)
    assert len(shard.version_log()) == 1
    assert versions_read(shard, [4]) == [2]
    shard.record_versions()  # starts from zero
    assert versions_read(shard, [4]) == [0]
