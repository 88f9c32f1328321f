"""Changing the trainer count of a Ray job while it trains (`psrec scale RUN_DIR --trainers N`).

Oracle for the model: the job's own checkpoint of the step of the change (written before the change)
resumed with ``ps.num_trainers`` set to the new count, undisturbed: both must end with every
table row and every dense weight equal, bit for bit. Oracle for the data: the row ids consumed,
counted by the driver from every trainer's batches, are the training set's rows (24,000), each once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec import checkpoint
from psrec.elastic.resharding import STATUS_FILE, request_scale
from psrec.elastic.shard_set import RayShards
from psrec.elastic.trainer_scaling import TrainerChange
from psrec.train.loop import train
from tests.conftest import small_run_config

CHANGE_AT = 6  # the step at which the count changes (a checkpoint step)
TRAIN_ROWS = 24_000


def config_of(sources: dict[str, Any], run_dir: Path, *, trainers: int, mode: str, **overrides: Any) -> Any:
    settings = {
        "ps.runtime": "ray",
        "ps.num_trainers": trainers,
        "ps.mode": mode,
        "checkpoint.every_steps": CHANGE_AT,
        "checkpoint.full_every": 1,
        "checkpoint.keep_last": 100,  # the change's checkpoint stays, for the oracle
        "training.log_every_steps": 3,
        "training.batch_size": 512,
        "training.shuffle_buffer": 1000,
        **overrides,
    }
    return small_run_config({"train": sources["train"]}, run_dir, **settings)


def finished(config: Any, sources: dict[str, Any], progress: Any = None, resume: bool | None = None) -> Any:
    from psrec.train.runtime import RayRuntime

    runtime = RayRuntime(config, base_dir=".", data_sources={"train": sources["train"]})
    if isinstance(progress, ChangeAt):
        progress.runtime = runtime
    try:
        summary = train(config, runtime=runtime, progress=progress, resume=resume)
        return summary, runtime.dense_states()[0], runtime.table_rows(), runtime.num_trainers
    finally:
        runtime.shutdown()


@pytest.fixture
def added_trainers_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Added trainers are waited for at the first boundary after the request (the switch lands on
    a known step; training would otherwise go on until they answer)."""
    import ray

    def ready(self: TrainerChange) -> bool:
        ray.get(self._answers, timeout=120)
        return True

    monkeypatch.setattr(TrainerChange, "ready", ready)


class ChangeAt:
    """Progress callback: ask for `trainers` trainers (and `shards` shards) once step CHANGE_AT is done."""

    def __init__(
        self,
        run_dir: Path,
        trainers: int,
        shards: int | None = None,
        *,
        kill_at: tuple[int, str, int] | None = None,
    ) -> None:
        self.run_dir, self.trainers, self.shards = run_dir, trainers, shards
        self.request: str | None = None
        self.kill_at = kill_at  # (step, "shards" or "trainers", index): SIGKILLed at that step's report
        self.runtime: Any = None
        self.killed: int | None = None

    def __call__(self, report: dict[str, Any]) -> None:
        if report["step"] == CHANGE_AT and self.request is None:
            self.request = request_scale(str(self.run_dir), self.shards, trainers=self.trainers)["id"]
        if self.kill_at is not None and report["step"] == self.kill_at[0] and self.killed is None:
            import ray

            actor = getattr(self.runtime, self.kill_at[1])[self.kill_at[2]]
            self.killed = int(ray.get(actor.pid.remote(), timeout=30))
            os.kill(self.killed, signal.SIGKILL)


def assert_same_model(run: Any, reference: Any) -> None:
    for name, value in reference[1].items():
        torch.testing.assert_close(run[1][name], value, rtol=0, atol=0, msg=name)
    assert run[2].keys() == reference[2].keys()
    for table, (ids, values) in reference[2].items():
        np.testing.assert_array_equal(run[2][table][0], ids, err_msg=table)
        np.testing.assert_array_equal(run[2][table][1], values, err_msg=table)


def copy_until(source: Path, destination: Path, step: int) -> Path:
    """A copy of run directory `source` as it was at checkpoint `step` (later checkpoints removed)."""
    shutil.copytree(source, destination)
    for ref in checkpoint.list_checkpoints(destination):
        if ref.step > step:
            shutil.rmtree(ref.path)
    for name in ("summary.json", STATUS_FILE):
        (destination / name).unlink()
    return destination


def changed_and_resumed(
    sources: dict[str, Any],
    tmp_path: Path,
    *,
    before: int,
    after: int,
    mode: str,
    shards: int | None = None,
    kill_at: tuple[int, str, int] | None = None,
) -> tuple[Any, Any, ChangeAt]:
    live_dir = tmp_path / "live"
    change = ChangeAt(live_dir, after, shards, kill_at=kill_at)
    live = finished(config_of(sources, live_dir, trainers=before, mode=mode), sources, change)
    # the oracle: the live run's checkpoint of the change's step (written before the change, by the
    # undisturbed job), resumed undisturbed with the new count
    resumed_dir = copy_until(live_dir, tmp_path / "resumed", CHANGE_AT)
    layout = {"ps.num_shards": shards} if shards is not None else {}
    resumed = finished(
        config_of(sources, resumed_dir, trainers=after, mode=mode, **layout), sources, resume=True
    )
    assert resumed[0]["resumed_from"]["step"] == CHANGE_AT
    return live, resumed, change


def check_change(live: Any, change: ChangeAt, *, before: int, after: int) -> dict[str, Any]:
    summary = live[0]
    assert live[3] == after
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == TRAIN_ROWS  # each row once
    entry = next(e for e in summary["resharding"] if e["id"] == change.request)
    assert entry["state"] == "done", entry
    assert (entry["from_trainers"], entry["trainers"], entry["switch"]["step"]) == (before, after, CHANGE_AT)
    assert summary["recoveries"] == []
    return entry


@pytest.mark.ray
def test_two_trainers_to_one_at_a_step_is_the_run_resumed_there_with_one(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """With shard failover (the default), shard 0 is also SIGKILLed three steps after the switch: it is
    rebuilt from its log (the checkpoint before the switch, the new trainer count, the steps since)
    and completes its steps with one trainer's pushes; no rollback."""
    live, resumed, change = changed_and_resumed(
        synthetic_sources, tmp_path, before=2, after=1, mode="sync", kill_at=(CHANGE_AT + 3, "shards", 0)
    )
    check_change(live, change, before=2, after=1)
    assert change.killed is not None
    assert [f["shard"] for f in live[0]["failovers"] if "shard" in f] == [0]
    assert_same_model(live, resumed)
    assert resumed[0]["rows_consumed"] == resumed[0]["rows_consumed_unique"] == TRAIN_ROWS
    assert json.loads((tmp_path / "live" / STATUS_FILE).read_text())["current"] is None


@pytest.mark.ray
@pytest.mark.slow
def test_a_trainer_added_while_training_is_replaced_alone_when_it_dies(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path, added_trainers_waited_for: None
) -> None:
    """1 -> 2 trainers, then the added trainer SIGKILLed three steps after the switch: trainer
    failover (decided with the trainer count of now) replaces it alone, no rollback, the model is
    the oracle's (the change's checkpoint resumed with 2)."""
    live, resumed, change = changed_and_resumed(
        synthetic_sources, tmp_path, before=1, after=2, mode="sync", kill_at=(CHANGE_AT + 3, "trainers", 1)
    )
    check_change(live, change, before=1, after=2)
    assert change.killed is not None
    assert [f for f in live[0]["failovers"] if "shard" not in f]  # the trainer's failover
    assert_same_model(live, resumed)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_trainer_to_two_at_a_step_is_the_run_resumed_there_with_two(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    mode: str,
    added_trainers_waited_for: None,
) -> None:
    live, resumed, change = changed_and_resumed(synthetic_sources, tmp_path, before=1, after=2, mode=mode)
    check_change(live, change, before=1, after=2)
    if mode == "sync":  # async pushes land in arrival order: only the data is exact
        assert_same_model(live, resumed)
    assert resumed[0]["rows_consumed"] == resumed[0]["rows_consumed_unique"] == TRAIN_ROWS


@pytest.mark.ray
@pytest.mark.slow
def test_trainers_and_shards_changed_together_are_the_run_resumed_with_both(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    added_trainers_waited_for: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1 -> 2 trainers and 2 -> 3 shards in one request: the trainers switch, then the buckets move."""
    import ray

    def ready(self: RayShards) -> bool:  # the new shard is waited for too: the move lands on step 6
        ray.get(self._answers, timeout=120)
        return True

    monkeypatch.setattr(RayShards, "ready", ready)
    live, resumed, change = changed_and_resumed(
        synthetic_sources, tmp_path, before=1, after=2, mode="sync", shards=3
    )
    entry = check_change(live, change, before=1, after=2)
    assert (entry["from_shards"], entry["shards"], entry["rounds"][0]["step"]) == (2, 3, CHANGE_AT)
    assert_same_model(live, resumed)


@pytest.mark.ray
@pytest.mark.slow
def test_a_checkpoint_written_after_the_change_resumes_into_any_trainer_count(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """2 -> 1 at step 6; the checkpoint of step 12 holds one trainer's share of the epoch. Resumed
    with 1 trainer it ends with the live run's model; resumed with 2, each row is still consumed once."""
    live_dir = tmp_path / "live"
    change = ChangeAt(live_dir, 1)
    live = finished(
        config_of(synthetic_sources, live_dir, trainers=2, mode="sync"), synthetic_sources, change
    )
    check_change(live, change, before=2, after=1)
    after = 2 * CHANGE_AT
    for trainers in (1, 2):
        run_dir = copy_until(live_dir, tmp_path / f"resumed-{trainers}", after)
        ref = next(r for r in checkpoint.list_checkpoints(run_dir) if r.step == after)
        assert len(checkpoint.load_checkpoint(ref, shards=[]).trainers) == 1  # the new count is recorded
        config = config_of(synthetic_sources, run_dir, trainers=trainers, mode="sync")
        resumed = finished(config, synthetic_sources, resume=True)
        assert resumed[0]["resumed_from"]["step"] == after and resumed[3] == trainers
        assert resumed[0]["rows_consumed"] == resumed[0]["rows_consumed_unique"] == TRAIN_ROWS
        if trainers == 1:  # an exact resume of the live run
            assert_same_model(resumed, live)
