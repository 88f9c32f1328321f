"""Changing the shard count of a Ray job while it trains, and shards killed during bucket moves.

The oracle is the same job on Ray, undisturbed, on 2 shards (sync mode): the job resharded
2 -> 3 -> 1 must end with every table row, every dense weight and the validation metrics equal,
bit for bit; so must the jobs whose shards are SIGKILLed while buckets move: with shard failover
(the default) the dead shards are rebuilt from their logs, which hold the moves, and nothing rolls
back; without it the driver rolls the job back to its last checkpoint, into the layout of that
moment, and the moves go on. New shard actors are waited for at the first boundary after the
request (`RayShards.ready` blocking), so the rounds land on known steps.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.elastic import shard_set
from psrec.elastic.resharding import STATUS_FILE, request_scale
from psrec.elastic.shard_set import RayShards
from psrec.train.loop import train
from tests.conftest import small_run_config

STEPS = 40


def ray_config(sources: dict[str, Any], run_dir: Path, *, failover: bool = True) -> Any:
    settings = {
        "ps.runtime": "ray",
        "checkpoint.every_steps": 20,
        "checkpoint.full_every": 2,
        "training.log_every_steps": 5,
        "training.max_steps": STEPS,
        "fault_tolerance.shard_failover": failover,
    }
    return small_run_config(sources, run_dir, **settings)


def finished(config: Any, sources: dict[str, Any], progress: Any = None) -> tuple[dict[str, Any], Any, Any]:
    from psrec.train.runtime import RayRuntime

    runtime = RayRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train(config, runtime=runtime, progress=progress)
        return summary, runtime.dense_states()[0], runtime.table_rows()
    finally:
        runtime.shutdown()


def assert_identical(run: tuple[Any, ...], reference: tuple[Any, ...]) -> None:
    (summary, dense, rows), (expected_summary, expected_dense, expected_rows) = run, reference
    for name, value in expected_dense.items():
        torch.testing.assert_close(dense[name], value, rtol=0, atol=0, msg=name)
    assert rows.keys() == expected_rows.keys()
    for table, (ids, values) in expected_rows.items():
        np.testing.assert_array_equal(rows[table][0], ids, err_msg=table)
        np.testing.assert_array_equal(rows[table][1], values, err_msg=table)
    assert summary["validation"] == expected_summary["validation"]


@pytest.fixture(scope="module")
def undisturbed(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, ...]:
    config = ray_config(synthetic_sources, tmp_path_factory.mktemp("undisturbed"), failover=False)
    return finished(config, synthetic_sources)


@pytest.fixture
def new_shards_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def ready(self: RayShards) -> bool:
        ray.get(self._answers, timeout=120)
        return True

    monkeypatch.setattr(RayShards, "ready", ready)


class Requests:
    """Progress callback: 3 shards at step 5, then 1 shard at step 15 (once each, a rollback too)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.ids: dict[int, str] = {}

    def __call__(self, report: dict[str, Any]) -> None:
        for step, shards, per_round in ((5, 3, 16), (15, 1, 16)):
            if report["step"] == step and shards not in self.ids:
                self.ids[shards] = request_scale(str(self.run_dir), shards, buckets_per_round=per_round)["id"]


@pytest.mark.ray
def test_a_ray_job_resharded_2_to_3_to_1_while_training_is_the_undisturbed_one(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    undisturbed: tuple[Any, ...],
    tmp_path: Path,
    new_shards_waited_for: None,
) -> None:
    requests = Requests(tmp_path)
    run = finished(ray_config(synthetic_sources, tmp_path), synthetic_sources, requests)
    assert_identical(run, undisturbed)
    summary = run[0]
    assert summary["recoveries"] == []
    assert len(summary["placement"]["shards"]) == 1  # the placement report follows the shard count
    handled = {entry["id"]: entry for entry in summary["resharding"]}
    grow, shrink = handled[requests.ids[3]], handled[requests.ids[1]]
    assert grow["state"] == shrink["state"] == "done"
    assert [r["step"] for r in grow["rounds"]] == [5, 10]
    assert [r["step"] for r in shrink["rounds"]] == [15, 20, 25]
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256
    assert json.loads((tmp_path / STATUS_FILE).read_text())["current"] is None


@pytest.mark.ray
def test_shards_killed_during_bucket_moves_are_rebuilt_from_their_logs_without_a_rollback(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    undisturbed: tuple[Any, ...],
    tmp_path: Path,
    new_shards_waited_for: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shard failover on: the new shard 2 is SIGKILLed as round 2 of 2 -> 3 copies buckets into it
    (its log holds round 1's import), and shard 1 right after it dropped round 2's buckets (its log
    holds the drop); both are rebuilt in place, the calls they missed are sent again, nothing is
    restored from the checkpoint and the model is the undisturbed one."""
    import ray

    move, drop, killed = RayShards.move, RayShards.drop, list[int]()

    def kill(shard: Any) -> None:
        killed.append(ray.get(shard.pid.remote(), timeout=30))
        os.kill(killed[-1], signal.SIGKILL)

    def move_into_a_dead_shard(self: RayShards, moves: list[Any], num_buckets: int) -> int:
        if self.runtime._routing_version == 1 and not killed:  # round 1 done: this is round 2
            kill(self.runtime.shards[2])
        return move(self, moves, num_buckets)

    def drop_and_die(self: RayShards, moves: list[Any], num_buckets: int) -> None:
        drop(self, moves, num_buckets)
        if self.runtime._routing_version == 2 and len(killed) == 1:
            kill(self.runtime.shards[1])

    monkeypatch.setattr(shard_set.RayShards, "move", move_into_a_dead_shard)
    monkeypatch.setattr(shard_set.RayShards, "drop", drop_and_die)
    requests = Requests(tmp_path)
    run = finished(ray_config(synthetic_sources, tmp_path), synthetic_sources, requests)
    assert len(killed) == 2
    assert_identical(run, undisturbed)
    summary = run[0]
    assert summary["recoveries"] == []
    rebuilt = [(f["shard"], f["operations_replayed"] > 0) for f in summary["failovers"]]
    assert rebuilt == [(2, True), (1, True)]
    handled = {entry["id"]: entry for entry in summary["resharding"]}
    assert handled[requests.ids[3]]["state"] == handled[requests.ids[1]]["state"] == "done"
    assert [r["step"] for r in handled[requests.ids[3]]["rounds"]] == [5, 10]
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256


@pytest.mark.ray
@pytest.mark.slow
def test_a_shard_killed_during_a_bucket_move_is_recovered_and_the_model_is_the_undisturbed_one(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    undisturbed: tuple[Any, ...],
    tmp_path: Path,
    new_shards_waited_for: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shard failover off: the second round of 2 -> 3 copies buckets to shard 2, SIGKILLed as the
    copy starts; the job rolls back."""
    import ray

    move, killed = RayShards.move, list[int]()

    def move_into_a_dead_shard(self: RayShards, moves: list[Any], num_buckets: int) -> int:
        if self.runtime._routing_version == 1 and not killed:  # round 1 done: this is round 2
            victim = self.runtime.shards[2]
            killed.append(ray.get(victim.pid.remote(), timeout=30))
            os.kill(killed[-1], signal.SIGKILL)
        return move(self, moves, num_buckets)

    monkeypatch.setattr(shard_set.RayShards, "move", move_into_a_dead_shard)
    requests = Requests(tmp_path)
    run = finished(ray_config(synthetic_sources, tmp_path, failover=False), synthetic_sources, requests)
    assert killed
    assert_identical(run, undisturbed)
    summary = run[0]
    assert [(r["failed_at_step"], r["restored_step"]) for r in summary["recoveries"]] == [(10, 0)]
    handled = {entry["id"]: entry for entry in summary["resharding"]}
    assert handled[requests.ids[3]]["state"] == handled[requests.ids[1]]["state"] == "done"
    # round 2 ran again at the first boundary after the rollback
    assert [r["step"] for r in handled[requests.ids[3]]["rounds"]] == [5, 0]
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256
