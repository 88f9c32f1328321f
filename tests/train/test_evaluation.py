"""Tests for the run's evaluation metrics and the early-stopping rule, on hand-worked values (no runtime).

Run: ``python -m pytest tests/train/test_evaluation.py -q``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from psrec.train.evaluation import (
    EarlyStoppingDecision,
    EarlyStoppingRecord,
    decide_early_stopping,
    evaluation_metrics,
    is_improvement,
)


def test_evaluation_metrics_of_scores_and_labels() -> None:
    # positives 0.8, 0.4; negatives 0.5, 0.4: AUC (1 + 1 + 0 + 0.5) / 4
    metrics = evaluation_metrics(
        {"labels": np.array([1, 0, 1, 0], np.float32), "scores": np.array([0.8, 0.5, 0.4, 0.4], np.float32)}
    )
    assert set(metrics) == {"auc", "logloss", "rows"}
    assert metrics["auc"] == pytest.approx(0.625)
    expected = -(math.log(0.8) + math.log(0.5) + math.log(0.4) + math.log(0.6)) / 4
    assert metrics["logloss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["rows"] == 4


def test_evaluation_metrics_of_ranks() -> None:
    # ranks 0, 3, 20: HR@1 1/3, HR@5 = HR@10 2/3, MRR (1 + 1/4 + 1/21) / 3
    metrics = evaluation_metrics({"ranks": np.array([0, 3, 20])})
    assert metrics["rows"] == 3
    assert metrics["hr@1"] == pytest.approx(1 / 3)
    assert metrics["hr@5"] == pytest.approx(2 / 3) and metrics["hr@10"] == pytest.approx(2 / 3)
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 3)
    assert metrics["mrr"] == pytest.approx((1 + 1 / 4 + 1 / 21) / 3)


def test_is_improvement() -> None:
    assert is_improvement(0.5, None, metric="auc")
    assert is_improvement(0.7, 0.6, metric="auc") and not is_improvement(0.6, 0.6, metric="auc")
    assert not is_improvement(0.5, 0.6, metric="auc")
    assert is_improvement(0.4, 0.45, metric="logloss") and not is_improvement(0.5, 0.45, metric="logloss")
    assert is_improvement(0.3, 0.2, metric="ndcg@10")  # every metric but logloss: higher is better
    assert not is_improvement(float("nan"), 0.6, metric="auc")
    assert is_improvement(float("nan"), None, metric="auc")


def decide(
    record: EarlyStoppingRecord, value: float, step: int, metric: str = "auc"
) -> EarlyStoppingDecision:
    return decide_early_stopping(record, value, step=step, metric=metric, patience=2, lr_decay=0.1)


def test_early_stopping_on_auc_hand_worked() -> None:
    """AUC 0.70 (step 10), 0.72 (20), 0.71 (30): decay x0.1, 0.73 (40): best again, 0.72, 0.70: stop."""
    first = decide(EarlyStoppingRecord(), 0.70, 10)
    assert first == EarlyStoppingDecision("improved", EarlyStoppingRecord(0.70, 10, 0, 1.0))
    second = decide(first.record, 0.72, 20)
    assert second == EarlyStoppingDecision("improved", EarlyStoppingRecord(0.72, 20, 0, 1.0))
    third = decide(second.record, 0.71, 30)
    assert third.action == "decay"
    assert third.record == EarlyStoppingRecord(0.72, 20, 1, 0.1)
    fourth = decide(third.record, 0.73, 40)  # an improvement resets the count, keeps the lr factor
    assert fourth.action == "improved"
    assert fourth.record == EarlyStoppingRecord(0.73, 40, 0, 0.1)
    fifth = decide(fourth.record, 0.72, 50)
    assert fifth.action == "decay" and fifth.record.lr_factor == pytest.approx(0.01)
    sixth = decide(fifth.record, 0.70, 60)  # patience 2 reached: stop, without another decay
    assert sixth == EarlyStoppingDecision("stop", EarlyStoppingRecord(0.73, 40, 2, fifth.record.lr_factor))


def test_early_stopping_on_logloss_and_ties() -> None:
    """Lower logloss is better; an equal value is no improvement."""
    record = EarlyStoppingRecord(best_metric=0.45, best_step=5)
    better = decide(record, 0.44, 10, metric="logloss")
    assert better.action == "improved" and better.record.best_metric == 0.44 and better.record.best_step == 10
    tie = decide(better.record, 0.44, 15, metric="logloss")
    assert tie.action == "decay" and tie.record.best_step == 10 and tie.record.bad_evals == 1
    worse = decide(better.record, 0.50, 15, metric="logloss")
    assert worse.action == "decay" and worse.record.best_metric == 0.44


def test_early_stopping_with_patience_one_stops_at_the_first_bad_evaluation() -> None:
    record = EarlyStoppingRecord(best_metric=0.8, best_step=3)
    decision = decide_early_stopping(record, 0.7, step=6, metric="auc", patience=1, lr_decay=0.5)
    assert decision == EarlyStoppingDecision("stop", EarlyStoppingRecord(0.8, 3, 1, 1.0))


def test_a_nan_evaluation_counts_as_a_bad_one() -> None:
    decision = decide(EarlyStoppingRecord(best_metric=0.7, best_step=10), float("nan"), 20)
    assert (
        decision.action == "decay" and decision.record.best_metric == 0.7 and decision.record.bad_evals == 1
    )
