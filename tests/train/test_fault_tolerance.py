"""Fault tolerance for real: SIGKILL a trainer or a shard actor mid-training, and resume from disk.

The job must finish, count every training row exactly once, and end with the undisturbed run's
model: in sync mode the rolled-back replay is deterministic, so it is the same run (rows, dense
weights and validation AUC / logloss equal to 1e-6).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from psrec.train.loop import train
from tests.conftest import small_run_config

ROWS = 24_000


def fault_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> Any:
    settings = {
        "ps.runtime": "ray",
        "checkpoint.every_steps": 20,
        "checkpoint.full_every": 2,
        "training.log_every_steps": 5,
        "fault_tolerance.shard_failover": False,  # the whole-job rollback is what these tests check
    }
    return small_run_config(sources, run_dir, **(settings | overrides))


class FinishedRun(NamedTuple):
    summary: dict[str, Any]
    dense: dict[str, torch.Tensor]  # the first trainer's final dense state
    rows: dict[str, tuple[np.ndarray, np.ndarray]]  # every table's final (ids, rows)


def train_and_keep_model(config: Any, runtime: Any, **kwargs: Any) -> FinishedRun:
    try:
        summary = train(config, runtime=runtime, **kwargs)
        return FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


def assert_same_model(run: FinishedRun, reference: FinishedRun) -> None:
    """The final model equals the reference's bit for bit, and so does its validation."""
    for metric in ("auc", "logloss"):
        assert run.summary["validation"][metric] == reference.summary["validation"][metric], metric
    for name, value in reference.dense.items():
        torch.testing.assert_close(run.dense[name], value, rtol=0, atol=0, msg=name)
    assert run.rows.keys() == reference.rows.keys()
    for table, (ids, values) in reference.rows.items():
        np.testing.assert_array_equal(run.rows[table][0], ids, err_msg=table)
        np.testing.assert_allclose(run.rows[table][1], values, rtol=0, atol=0, err_msg=table)


@pytest.fixture(scope="module")
def undisturbed(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> FinishedRun:
    from psrec.train.runtime import RayRuntime

    config = fault_config(synthetic_sources, tmp_path_factory.mktemp("undisturbed"))
    return train_and_keep_model(config, RayRuntime(config, base_dir=".", data_sources=synthetic_sources))


@pytest.mark.ray
@pytest.mark.parametrize("victim", ["trainer", "shard"])
def test_sigkill_mid_training_loses_nothing(
    ray_cluster: None,
    synthetic_sources: dict[str, Any],
    undisturbed: FinishedRun,
    tmp_path: Path,
    victim: str,
) -> None:
    """In sync mode the rolled-back replay is deterministic: the final model is the undisturbed one."""
    import ray

    from psrec.train.runtime import RayRuntime

    config = fault_config(synthetic_sources, tmp_path)
    runtime = RayRuntime(config, base_dir=".", data_sources=synthetic_sources)
    killed: list[int] = []

    def kill_once(report: dict[str, Any]) -> None:
        if report["step"] >= 35 and not killed:  # after the step-20 checkpoint, before step 40's
            actor = runtime.trainers[0] if victim == "trainer" else runtime.shards[1]
            pid = ray.get(actor.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    run = train_and_keep_model(config, runtime, progress=kill_once)
    summary = run.summary
    assert killed, "the victim was never killed"
    assert len(summary["recoveries"]) == 1
    assert summary["recoveries"][0]["restored_step"] == 20
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    assert summary["steps"] == undisturbed.summary["steps"]
    assert_same_model(run, undisturbed)


@pytest.mark.ray
def test_resume_from_disk_equals_uninterrupted(
    ray_cluster: None, synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path
) -> None:
    """Stop after 40 steps (as if the driver died), then resume the run directory to the end."""
    first = train(fault_config(synthetic_sources, tmp_path, **{"training.max_steps": 40}))
    assert first["steps"] == 40
    (tmp_path / "summary.json").unlink()  # an interrupted run leaves no summary
    resumed = train(fault_config(synthetic_sources, tmp_path), resume=True)
    assert resumed["steps"] == undisturbed.summary["steps"]
    assert resumed["rows_consumed"] == ROWS
    assert resumed["validation"]["auc"] == pytest.approx(undisturbed.summary["validation"]["auc"], abs=1e-6)


def test_resume_skips_a_corrupt_checkpoint_and_refuses_another_config(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    from psrec.checkpoint import ConfigMismatchError, list_checkpoints

    settings = {"checkpoint.every_steps": 10, "training.log_every_steps": 5}
    first = train(small_run_config(synthetic_sources, tmp_path, **settings, **{"training.max_steps": 30}))
    assert first["steps"] == 30
    newest = list_checkpoints(tmp_path)[-1]
    assert newest.step == 30
    shard_file = newest.path / "shard-0.npz"
    shard_file.write_bytes(shard_file.read_bytes()[:-100] + b"\0" * 100)  # same size, bad checksum
    (tmp_path / "summary.json").unlink()

    with pytest.raises(ConfigMismatchError, match="model.top_hidden_sizes"):
        train(
            small_run_config(synthetic_sources, tmp_path, **settings, **{"model.top_hidden_sizes": [8]}),
            resume=True,
        )

    resumed = train(small_run_config(synthetic_sources, tmp_path, **settings), resume=True)
    assert resumed["resumed_from"]["step"] == 20  # the corrupt step-30 checkpoint was skipped
    assert resumed["steps"] == 94
    assert resumed["rows_consumed"] == ROWS


def test_checkpoint_config_from_an_older_schema_is_normalised(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """A field added to the schema after a checkpoint was written (at its default) is not a difference."""
    from psrec.config import normalized_fingerprint

    config = small_run_config(synthetic_sources, tmp_path)
    saved = config.fingerprint_dict()
    del saved["training"]["cache_data"]  # as written before the field existed
    del saved["ps"]["strategy"]
    assert saved != config.fingerprint_dict()
    assert normalized_fingerprint(saved) == config.fingerprint_dict()


def test_the_best_model_survives_a_restart_through_its_kept_checkpoint(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """Early stopping keeps the best model in memory; after a restart it comes from its checkpoint,
    which retention keeps even when newer chains would have pushed it out (keep_last=1)."""
    settings = {
        "training.epochs": 2,
        "training.early_stopping": {"metric": "auc", "patience": 5},
        "checkpoint.every_steps": 20,
        "checkpoint.full_every": 2,
        "checkpoint.keep_last": 1,
    }
    first = train(small_run_config(synthetic_sources, tmp_path, **settings, **{"training.max_steps": 150}))
    assert first["best_step"] == 94  # the one validation so far: the end of epoch 1 (94 batches of 256)
    names = [path.name for path in (tmp_path / "checkpoints").iterdir()]
    assert any(name.startswith("ckpt-000000094") for name in names), names  # pinned by retention
    assert any(name.startswith("ckpt-000000140") for name in names), names
    (tmp_path / "summary.json").unlink()  # as if the driver had died at step 150
    # Resume with one epoch (epochs are not part of the fingerprint): nothing left to train, so the
    # final evaluation needs the best model, whose in-memory snapshot died with the first driver.
    resumed = train(
        small_run_config(synthetic_sources, tmp_path, **(settings | {"training.epochs": 1})), resume=True
    )
    assert resumed["best_model"].startswith("checkpoint ckpt-000000094")
    best = next(entry for entry in resumed["history"] if entry["step"] == 94)
    assert resumed["validation"]["auc"] == pytest.approx(best["auc"], abs=1e-9)
