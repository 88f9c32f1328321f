"""The pure parts of trainer failover: when it applies, the survivors' common step, merged chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.elastic.trainer_failover import NoFailover, common_step, failover_refusal, merge_chunks
from psrec.trainer.chunks import ChunkResult
from tests.conftest import small_run_config

SOURCES: dict[str, Any] = {"train": {"format": "parquet", "paths": ["x.parquet"]}}


def config(**overrides: Any) -> Any:
    settings = {"ps.runtime": "ray", "ps.num_trainers": 2, "fault_tolerance.shard_failover": True}
    return small_run_config(SOURCES, Path("run"), **(settings | overrides))


def test_a_trainer_is_replaced_alone_only_where_a_survivor_holds_its_replica() -> None:
    assert failover_refusal(config()) is None
    assert "one trainer" in str(failover_refusal(config(**{"ps.num_trainers": 1})))
    assert "async" in str(failover_refusal(config(**{"ps.mode": "async"})))
    assert "shard_failover" in str(failover_refusal(config(**{"fault_tolerance.shard_failover": False})))
    assert "trainer_failover" in str(failover_refusal(config(**{"fault_tolerance.trainer_failover": False})))
    assert "strategy" in str(failover_refusal(config(**{"ps.runtime": "local", "ps.num_trainers": 1})))


def test_survivors_must_have_completed_the_same_step() -> None:
    assert common_step([{"step": 7}, {"step": 7}]) == 7
    with pytest.raises(NoFailover, match=r"\[6, 7\]"):
        common_step([{"step": 7}, {"step": 6}])


def chunk(steps: int, rows: list[int], *, exhausted: bool = False, state: Any = None) -> ChunkResult:
    return ChunkResult(
        steps=steps,
        samples=len(rows),
        loss_sum=float(len(rows)),
        scores=np.full(len(rows), 0.5, np.float32),
        labels=np.ones(len(rows), np.float32),
        row_ids=np.array(rows, np.int64),
        exhausted=exhausted,
        phase_seconds={"pull": 1.0},
        bytes_pulled=10,
        bytes_pushed=5,
        input_counts={"rows_skipped": 1},
        failed_units=[{"file": str(steps)}],
        first_step_at=float(steps) if steps else None,
        state=state,
    )


def test_the_parts_of_a_chunk_add_up_to_one_result() -> None:
    parts = [chunk(2, [1, 2]), chunk(0, []), chunk(3, [3, 4, 5], state={"step": 5})]
    merged = merge_chunks(parts, max_steps=5)
    assert merged.steps == 5 and not merged.exhausted
    np.testing.assert_array_equal(merged.row_ids, [1, 2, 3, 4, 5])
    assert merged.samples == 5 and merged.scores.shape == merged.labels.shape == (5,)
    assert merged.bytes_pulled == 30 and merged.phase_seconds == {"pull": 3.0}
    assert merged.input_counts == {"rows_skipped": 3} and len(merged.failed_units) == 3
    assert merged.first_step_at == 2.0 and merged.state == {"step": 5}
    assert merge_chunks([chunk(2, [1]), chunk(1, [2])], max_steps=5).exhausted
