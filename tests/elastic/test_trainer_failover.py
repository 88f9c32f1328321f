"""Trainer failover for real: SIGKILL a trainer actor mid-epoch; only that trainer is replaced.

Two sync trainers, logged shards. The job must finish without a rollback (no recovery in the
summary), every training row counted once, the shards the same processes never restored or
rebuilt, and end with the undisturbed run's model: every table row, every dense weight and the
validation metrics bit for bit equal (sync mode is deterministic, and the repeated step reads the
rows its first copy read). The oracle is the same job never disturbed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.elastic.test_failover import (
    STEPS,
    FinishedRun,
    Killer,
    assert_identical_model,
    failover_config,
    run_to_the_end,
)

TRAINERS = {"ps.num_trainers": 2}


@pytest.fixture(scope="module")
def undisturbed_pair(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> FinishedRun:
    from psrec.train.runtime import RayRuntime

    config = failover_config(synthetic_sources, tmp_path_factory.mktemp("undisturbed"), **TRAINERS)
    return run_to_the_end(config, RayRuntime(config, base_dir=".", data_sources=synthetic_sources))


class ReplacementKiller(Killer):
    """Kills trainer `victim`, then the actor that replaces it as soon as it exists."""

    def _kill(self) -> None:
        import ray

        try:
            first = self.runtime.trainers[self.victim]
            pid = ray.get(first.pid.remote(), timeout=30)
            time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
            deadline = time.monotonic() + 120
            while self.runtime.trainers[self.victim] is first and time.monotonic() < deadline:
                time.sleep(0.005)
            replacement = ray.get(self.runtime.trainers[self.victim].pid.remote(), timeout=60)
            os.kill(replacement, signal.SIGKILL)
            self.killed.append(replacement)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)


def killed_trainer_run(
    sources: dict[str, Any], run_dir: Path, *, victim: int, killer_class: type[Killer] = Killer
) -> tuple[FinishedRun, Killer, list[int]]:
    from psrec.train.runtime import RayRuntime

    config = failover_config(sources, run_dir, **TRAINERS)
    runtime = RayRuntime(config, base_dir=".", data_sources=sources)
    shard_pids = [report["pid"] for report in runtime.failover_reports() if report is not None]
    killer = killer_class(runtime, victim=victim, after=25, twice=False)
    killer.trainer = True
    run = run_to_the_end(config, runtime, progress=killer)
    killer.join()
    return run, killer, shard_pids


def assert_replaced_alone(run: FinishedRun, shard_pids: list[int], *, failovers: int = 1) -> None:
    summary = run.summary
    assert summary["recoveries"] == []  # no rollback
    assert summary["steps"] == STEPS
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256 * 2
    for report, pid in zip(run.reports, shard_pids, strict=True):  # the shards: untouched
        assert report is not None and report["pid"] == pid
        assert report["restores"] == 0 and report["recovery"] is None
    trainer_failovers = [f for f in summary["failovers"] if "trainers" in f]
    assert len(trainer_failovers) == failovers and all("shard" not in f for f in summary["failovers"])
    assert all(25 <= f["step"] < STEPS for f in trainer_failovers)


@pytest.mark.ray
def test_a_killed_trainer_is_replaced_alone_and_the_model_is_the_undisturbed_one(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed_pair: FinishedRun, tmp_path: Path
) -> None:
    run, killer, shard_pids = killed_trainer_run(synthetic_sources, tmp_path, victim=1)
    assert len(killer.killed) == 1
    assert_replaced_alone(run, shard_pids)
    assert_identical_model(run, undisturbed_pair)


@pytest.mark.ray
@pytest.mark.slow
def test_trainer_0_serving_the_group_store_is_replaced_alone_too(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed_pair: FinishedRun, tmp_path: Path
) -> None:
    run, _, shard_pids = killed_trainer_run(synthetic_sources, tmp_path, victim=0)
    assert_replaced_alone(run, shard_pids)
    assert_identical_model(run, undisturbed_pair)


@pytest.mark.ray
@pytest.mark.slow
def test_the_replacement_killed_during_the_failover_is_replaced_again(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed_pair: FinishedRun, tmp_path: Path
) -> None:
    run, killer, shard_pids = killed_trainer_run(
        synthetic_sources, tmp_path, victim=1, killer_class=ReplacementKiller
    )
    assert len(killer.killed) == 2
    summary = run.summary
    assert summary["recoveries"] == []
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256 * 2
    assert [f["trainers"] for f in summary["failovers"]] in ([[1]], [[1], [1]])
    for report, pid in zip(run.reports, shard_pids, strict=True):
        assert report is not None and report["pid"] == pid and report["restores"] == 0
    assert_identical_model(run, undisturbed_pair)
