"""Shard failover for real: SIGKILL a shard actor mid-epoch; only that shard is rebuilt.

With ``fault_tolerance.shard_failover`` the job must finish without a rollback (no recovery in the
summary, no step recomputed), every training row counted once, the other shards never restored nor
replaced, and in sync mode end with the undisturbed run's model: every table row and every dense
weight bit for bit equal. The second kill hits the replacement while it is still rebuilding.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from psrec.train.loop import train
from tests.conftest import small_run_config

STEPS = 40  # checkpoints at 0, 20 and 40: a kill after step 25 is rebuilt from step 20's


def failover_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> Any:
    settings = {
        "ps.runtime": "ray",
        "checkpoint.every_steps": 20,
        "checkpoint.full_every": 2,
        "training.log_every_steps": 5,
        "training.max_steps": STEPS,
        "fault_tolerance.shard_failover": True,
    }
    return small_run_config(sources, run_dir, **(settings | overrides))


class FinishedRun(NamedTuple):
    summary: dict[str, Any]
    dense: dict[str, torch.Tensor]
    rows: dict[str, tuple[np.ndarray, np.ndarray]]
    reports: list[dict[str, Any] | None]  # each shard's log report at the end


def run_to_the_end(config: Any, runtime: Any, **kwargs: Any) -> FinishedRun:
    try:
        summary = train(config, runtime=runtime, **kwargs)
        return FinishedRun(
            summary, runtime.dense_states()[0], runtime.table_rows(), runtime.failover_reports()
        )
    finally:
        runtime.shutdown()


def assert_identical_model(run: FinishedRun, reference: FinishedRun) -> None:
    for name, value in reference.dense.items():
        torch.testing.assert_close(run.dense[name], value, rtol=0, atol=0, msg=name)
    assert run.rows.keys() == reference.rows.keys()
    for table, (ids, values) in reference.rows.items():
        np.testing.assert_array_equal(run.rows[table][0], ids, err_msg=table)
        np.testing.assert_array_equal(run.rows[table][1], values, err_msg=table)
    assert run.summary["validation"] == reference.summary["validation"]


def wait_for_recovering_pid(directory: Path, *, not_in: list[int], timeout: float = 120.0) -> int:
    """The pid of the process rebuilding a shard (`recovering.json`), once it is a new one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(json.loads((directory / "recovering.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pid = -1
        if pid > 0 and pid not in not_in:
            return pid
        time.sleep(0.01)
    raise TimeoutError(f"no new process started rebuilding {directory} within {timeout} s")


class Killer:
    """Kills shard `victim` once, during the chunk after step `after`, and then (with `twice`) its
    replacement while it rebuilds; on a thread, so the kills land mid-chunk. With `at_boundary` the
    kill happens in the progress report itself, so the driver's next call (a checkpoint when
    `after` is a checkpoint step) meets the dead shard."""

    def __init__(
        self, runtime: Any, *, victim: int, after: int, twice: bool, at_boundary: bool = False
    ) -> None:
        self.runtime, self.victim, self.after, self.twice = runtime, victim, after, twice
        self.at_boundary = at_boundary
        self.trainer = False  # kill trainer `victim` instead of a shard
        self.killed: list[int] = []
        self.errors: list[BaseException] = []
        self.thread: threading.Thread | None = None

    def __call__(self, report: dict[str, Any]) -> None:
        if report["step"] >= self.after and self.thread is None:
            self.thread = threading.Thread(target=self._kill, daemon=True)
            self.thread.start()
            if self.at_boundary:
                self.thread.join(timeout=60)

    def _kill(self) -> None:
        import ray

        try:
            actors = self.runtime.trainers if self.trainer else self.runtime.shards
            pid = ray.get(actors[self.victim].pid.remote(), timeout=30)
            if not self.at_boundary:
                time.sleep(0.05)  # into the next chunk's pulls and pushes
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
            if self.twice:
                directory = self.runtime._failover.shard_directory(self.victim)
                replacement = wait_for_recovering_pid(directory, not_in=self.killed)
                os.kill(replacement, signal.SIGKILL)
                self.killed.append(replacement)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)

    def join(self) -> None:
        assert self.thread is not None, "the kill was never triggered"
        self.thread.join(timeout=180)
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def undisturbed(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> FinishedRun:
    from psrec.train.runtime import RayRuntime

    config = failover_config(synthetic_sources, tmp_path_factory.mktemp("undisturbed"))
    return run_to_the_end(config, RayRuntime(config, base_dir=".", data_sources=synthetic_sources))


def killed_run(
    sources: dict[str, Any],
    run_dir: Path,
    *,
    twice: bool,
    after: int = 25,
    at_boundary: bool = False,
    **overrides: Any,
) -> tuple[FinishedRun, Killer, list[int]]:
    from psrec.train.runtime import RayRuntime

    config = failover_config(sources, run_dir, **overrides)
    runtime = RayRuntime(config, base_dir=".", data_sources=sources)
    first_pids = [report["pid"] for report in runtime.failover_reports() if report is not None]
    killer = Killer(runtime, victim=1, after=after, twice=twice, at_boundary=at_boundary)
    run = run_to_the_end(config, runtime, progress=killer)
    killer.join()
    assert len(killer.killed) == (2 if twice else 1)
    return run, killer, first_pids


def assert_failed_over_alone(
    run: FinishedRun, killer: Killer, first_pids: list[int], *, base_step: int = 20, trainers: int = 1
) -> None:
    """No rollback, every row once, shard 0 the same process never restored, shard 1 rebuilt."""
    summary = run.summary
    assert summary["recoveries"] == []  # no rollback: nothing recomputed
    assert summary["steps"] == STEPS
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == STEPS * 256 * trainers
    survivor, rebuilt = run.reports
    assert survivor is not None and rebuilt is not None
    assert survivor["pid"] == first_pids[0] and survivor["recovery"] is None and survivor["restores"] == 0
    assert rebuilt["pid"] not in killer.killed + first_pids and rebuilt["restores"] == 0
    assert rebuilt["recovery"] is not None and rebuilt["recovery"]["base_step"] == base_step
    # the one rebuild that finished (a replacement killed while rebuilding never reports)
    assert [failover["shard"] for failover in summary["failovers"]] == [1]


@pytest.mark.ray
def test_a_killed_shard_is_rebuilt_alone_and_the_model_is_the_undisturbed_one(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path
) -> None:
    run, killer, first_pids = killed_run(synthetic_sources, tmp_path, twice=False)
    assert_failed_over_alone(run, killer, first_pids)
    assert_identical_model(run, undisturbed)


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_kill_while_the_replacement_rebuilds_costs_no_rollback_either(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path
) -> None:
    run, killer, first_pids = killed_run(synthetic_sources, tmp_path, twice=True)
    assert_failed_over_alone(run, killer, first_pids)
    assert_identical_model(run, undisturbed)


@pytest.mark.ray
@pytest.mark.slow
def test_a_shard_killed_just_before_a_checkpoint_writes_it_after_its_rebuild(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path
) -> None:
    """The driver's checkpoint calls meet the dead shard: they are sent again once it is back."""
    run, killer, first_pids = killed_run(synthetic_sources, tmp_path, twice=False, after=20, at_boundary=True)
    assert_failed_over_alone(run, killer, first_pids, base_step=0)
    assert_identical_model(run, undisturbed)


@pytest.mark.ray
@pytest.mark.slow
def test_two_sync_trainers_with_a_step_half_pushed_lose_nothing(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """Two trainers: the shard may die holding one trainer's push of a step and not the other's."""
    from psrec.train.runtime import RayRuntime

    config = failover_config(synthetic_sources, tmp_path / "undisturbed", **{"ps.num_trainers": 2})
    reference = run_to_the_end(config, RayRuntime(config, base_dir=".", data_sources=synthetic_sources))
    run, killer, first_pids = killed_run(
        synthetic_sources, tmp_path / "killed", twice=False, **{"ps.num_trainers": 2}
    )
    assert_failed_over_alone(run, killer, first_pids, trainers=2)
    assert_identical_model(run, reference)


@pytest.mark.ray
@pytest.mark.slow
def test_async_trainers_go_on_through_a_shard_failover(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """Async mode: pushes left unacknowledged and pulls prefetched when the shard died are sent again;
    the run ends without a rollback, every row consumed once, the other shard untouched."""
    overrides = {"ps.num_trainers": 2, "ps.mode": "async", "ps.staleness": 2}
    run, killer, first_pids = killed_run(synthetic_sources, tmp_path, twice=False, **overrides)
    assert_failed_over_alone(run, killer, first_pids, trainers=2)
    assert run.summary["validation"]["auc"] > 0.6


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_trainer_still_rolls_back_exactly_with_logged_shards(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path
) -> None:
    """Trainer death is a rollback: the logged shards are restored from the checkpoint (a new log
    segment on it) and the replayed steps end with the undisturbed model."""
    from psrec.train.runtime import RayRuntime

    config = failover_config(synthetic_sources, tmp_path)
    runtime = RayRuntime(config, base_dir=".", data_sources=synthetic_sources)
    killer = Killer(runtime, victim=0, after=25, twice=False)
    killer.trainer = True
    run = run_to_the_end(config, runtime, progress=killer)
    killer.join()
    assert [recovery["restored_step"] for recovery in run.summary["recoveries"]] == [20]
    assert run.summary["failovers"] == []
    assert all(report is not None and report["restores"] == 1 for report in run.reports)
    assert_identical_model(run, undisturbed)
