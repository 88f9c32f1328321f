"""Exact resume from a delta checkpoint, on the in-process runtime (`ps.runtime: local`) and on Ray.

A run stopped at a checkpoint and resumed from its run directory must end with the model of the
same run left undisturbed: every table's ids and rows, every dense weight and the validation
metrics equal (sync mode, one trainer; the oracle is the undisturbed run of the same config).
The stops land on a delta checkpoint, which the driver then checkpoints again at the same step
(the max_steps stop), as a run does at an epoch's end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from psrec.checkpoint import list_checkpoints
from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config

# Checkpoints at steps 0 (full), 10, 20 (deltas), 30 (full, ...): a stop at 10 or 20 is on a delta.
SETTINGS = {"checkpoint.every_steps": 10, "checkpoint.full_every": 3, "training.log_every_steps": 5}
STEPS = 40


class FinishedRun(NamedTuple):
    summary: dict[str, Any]
    dense: dict[str, torch.Tensor]
    rows: dict[str, tuple[np.ndarray, np.ndarray]]


def run_to(
    sources: dict[str, Any], run_dir: Path, max_steps: int, *, ray: bool = False, **kwargs: Any
) -> FinishedRun:
    settings = SETTINGS | {"training.max_steps": max_steps, "ps.runtime": "ray" if ray else "local"}
    config = small_run_config(sources, run_dir, **settings)
    if ray:
        from psrec.train.runtime import RayRuntime

        runtime: Any = RayRuntime(config, base_dir=".", data_sources=sources)
    else:
        runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train(config, runtime=runtime, **kwargs)
        return FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


@pytest.fixture(scope="module")
def undisturbed(synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    return run_to(synthetic_sources, tmp_path_factory.mktemp("undisturbed"), STEPS)


def assert_same_model(run: FinishedRun, reference: FinishedRun) -> None:
    assert run.summary["steps"] == reference.summary["steps"] == STEPS
    for metric in ("auc", "logloss"):
        assert run.summary["validation"][metric] == reference.summary["validation"][metric], metric
    assert run.rows.keys() == reference.rows.keys()
    for table, (ids, values) in reference.rows.items():
        np.testing.assert_array_equal(run.rows[table][0], ids, err_msg=table)
        np.testing.assert_allclose(run.rows[table][1], values, rtol=0, atol=0, err_msg=table)
    for name, value in reference.dense.items():
        torch.testing.assert_close(run.dense[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stops", [[10], [20, 20]], ids=["stop-at-10", "stop-at-20-and-resume-idle"])
def test_resume_from_a_delta_checkpoint_equals_uninterrupted(
    synthetic_sources: dict[str, Any], undisturbed: FinishedRun, tmp_path: Path, stops: list[int]
) -> None:
    """Stop at `stops` (a second stop at the same step resumes with nothing to train and checkpoints
    the restored state again), then resume the run directory to the end."""
    for index, stop in enumerate(stops):
        leg = run_to(synthetic_sources, tmp_path, stop, resume=True if index else None)
        assert leg.summary["steps"] == stop
        steps = [ref.step for ref in list_checkpoints(tmp_path)]
        assert steps[-1] == stop and len(steps) == len(set(steps)), steps  # one checkpoint a step
        (tmp_path / "summary.json").unlink()  # an interrupted run leaves no summary
    resumed = run_to(synthetic_sources, tmp_path, STEPS, resume=True)
    assert resumed.summary["resumed_from"]["step"] == stops[-1]
    assert resumed.summary["rows_consumed"] == undisturbed.summary["rows_consumed"]
    assert_same_model(resumed, undisturbed)


@pytest.mark.slow
@pytest.mark.ray
def test_resume_from_a_delta_checkpoint_equals_uninterrupted_on_ray(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    reference = run_to(synthetic_sources, tmp_path / "undisturbed", STEPS, ray=True)
    run_to(synthetic_sources, tmp_path / "resumed", 10, ray=True)
    (tmp_path / "resumed" / "summary.json").unlink()
    resumed = run_to(synthetic_sources, tmp_path / "resumed", STEPS, ray=True, resume=True)
    assert resumed.summary["resumed_from"]["step"] == 10
    assert_same_model(resumed, reference)
