"""Validation during and after a run: each model evaluated once, and the summary's metrics those of
the model the run ends with, scored by scikit-learn on that model's own predictions. A second
evaluation of the same model costs a pass over the validation set (millions of rows on real data)
and, under early stopping, counts as one more evaluation without improvement.

Run: ``python -m pytest tests/train/test_final_evaluation.py -q``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sklearn.metrics import log_loss, roc_auc_score

from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config


def _run(sources: dict[str, Any], run_dir: Path, **settings: Any) -> tuple[dict[str, Any], list[str], Any]:
    """Train in process, counting the runtime's evaluations; returns the summary, the splits each
    evaluation was of, and the final model's own validation predictions (the oracle's input)."""
    config = small_run_config(sources, run_dir, **settings)
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    evaluate = runtime.evaluate
    calls: list[str] = []

    def counted(split: str) -> Any:
        calls.append(split)
        return evaluate(split)

    runtime.evaluate = counted  # type: ignore[method-assign]
    try:
        summary = train(config, runtime=runtime)
        return summary, calls, evaluate("validation")
    finally:
        runtime.shutdown()


def _assert_metrics_of(metrics: dict[str, Any], parts: dict[str, Any]) -> None:
    labels, scores = parts["labels"], parts["scores"]
    assert metrics["rows"] == labels.size == 6_000
    assert metrics["auc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
    assert metrics["logloss"] == pytest.approx(log_loss(labels, scores.astype("float64")), rel=1e-5)


def test_the_final_model_is_evaluated_once_at_the_epochs_end(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    summary, calls, parts = _run(synthetic_sources, tmp_path / "run")
    assert calls == ["validation"]  # the epoch's end; the summary takes its metrics
    assert summary["history"][-1]["step"] == summary["steps"] > 0
    assert summary["best_model"] == "last"
    _assert_metrics_of(summary["validation"], parts)


def test_a_restored_best_model_is_evaluated_again(synthetic_sources: dict[str, Any], tmp_path: Path) -> None:
    # evaluations every 20 steps and at the epoch's end; the summary is of the best one's snapshot
    summary, calls, parts = _run(
        synthetic_sources,
        tmp_path / "run",
        **{"training.eval_every_steps": 20, "training.early_stopping": {"metric": "auc", "patience": 50}},
    )
    evaluations = len(summary["history"])
    assert evaluations >= 3 and summary["best_model"] == "memory"
    assert calls == ["validation"] * (evaluations + 1)  # the best model's, after the run
    best = next(entry for entry in summary["history"] if entry["step"] == summary["best_step"])
    for metric in ("auc", "logloss", "rows"):  # the same model: the same metrics as when it was best
        assert summary["validation"][metric] == pytest.approx(best[metric], abs=1e-9)
    # `parts` is of the restored best model too (evaluated again after the run)
    _assert_metrics_of(summary["validation"], parts)


def test_an_epochs_end_on_a_periodic_evaluation_is_not_evaluated_again(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    # 24,000 rows in batches of 480: 50 steps an epoch, evaluations due every 25, the 2nd on the end
    summary, calls, parts = _run(
        synthetic_sources,
        tmp_path / "run",
        **{"training.batch_size": 480, "training.epochs": 2, "training.eval_every_steps": 25},
    )
    assert summary["steps"] == 100
    assert [entry["step"] for entry in summary["history"]] == [25, 50, 75, 100]
    assert calls == ["validation"] * 4
    _assert_metrics_of(summary["validation"], parts)


def test_eval_every_epochs_validates_every_nth_epoch_end_and_the_last(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    # 24,000 rows in batches of 960: 25 steps an epoch; 3 epochs, the 2nd validated, and the last
    summary, calls, parts = _run(
        synthetic_sources,
        tmp_path / "run",
        **{"training.batch_size": 960, "training.epochs": 3, "training.eval_every_epochs": 2},
    )
    assert summary["steps"] == 75
    assert [(entry["epoch"], entry["step"]) for entry in summary["history"]] == [(1, 50), (2, 75)]
    assert calls == ["validation"] * 2
    _assert_metrics_of(summary["validation"], parts)
