"""Validation metrics of a run and the early-stopping decision the driver takes after each evaluation.

`evaluation_metrics` turns what the trainers returned for a split (scores and labels, or the ranks
of ranking models) into the metrics the run reports. `decide_early_stopping` is the rule over plain
values (no runtime): an evaluation that beats the best so far (higher, or lower for logloss) becomes
the best and resets the count of bad evaluations; otherwise the count grows, and the run stops when
it reaches `patience`, or else every learning rate is multiplied by `lr_decay`. The driver
(`psrec.train.loop`) applies the decision: it snapshots the best model, stops, or scales the rates.

Tests: ``python -m pytest tests/train/test_evaluation.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from psrec.trainer.metrics import auc, logloss, ranking_metrics

Action = Literal["improved", "decay", "stop"]
SAMPLED_CUTOFFS = (1, 5, 10)  # among 1 + 100 candidates
FULL_CUTOFFS = (1, 5, 10, 50, 200)  # among every item: generative-recommenders' HR/NDCG@10, 50, 200


def evaluation_metrics(parts: dict[str, np.ndarray]) -> dict[str, float]:
    """AUC and logloss of ``{"labels", "scores"}``, or HR/NDCG at 1, 5, 10 and MRR of ``{"ranks"}``; and "rows".

    Ranks over all items (``"full_ranks"``, besides the sampled ``"ranks"``) add ``full_hr@K`` and
    ``full_ndcg@K`` at K = 1, 5, 10, 50, 200 and ``full_mrr``.
    """
    if "ranks" in parts:
        metrics = {**ranking_metrics(parts["ranks"], ks=SAMPLED_CUTOFFS), "rows": int(parts["ranks"].size)}
        if "full_ranks" in parts:
            full = ranking_metrics(parts["full_ranks"], ks=FULL_CUTOFFS)
            metrics.update({f"full_{name}": value for name, value in full.items()})
        return metrics
    labels, scores = parts["labels"], parts["scores"]
    return {"auc": auc(labels, scores), "logloss": logloss(labels, scores), "rows": int(labels.size)}


def is_improvement(value: float, best: float | None, *, metric: str) -> bool:
    """Whether `value` beats `best` (None: nothing yet, so it does): lower is better for logloss only.

    A NaN value never beats a best one (the comparison is false), but it is the first best.
    """
    if best is None:
        return True
    return value < best if metric == "logloss" else value > best


@dataclass(frozen=True)
class EarlyStoppingRecord:
    """Where early stopping stands: the best value and its step, bad evaluations since, the lr factor."""

    best_metric: float | None = None
    best_step: int = -1
    bad_evals: int = 0  # evaluations since the best that did not beat it
    lr_factor: float = 1.0  # product of the decays applied so far


@dataclass(frozen=True)
class EarlyStoppingDecision:
    """What to do after an evaluation, and the record after it.

    ``"improved"``: a new best (the driver snapshots the model); ``"stop"``: patience ran out;
    ``"decay"``: no improvement yet, multiply every learning rate by `lr_decay`.
    """

    action: Action
    record: EarlyStoppingRecord


def decide_early_stopping(
    record: EarlyStoppingRecord,
    value: float,
    *,
    step: int,
    metric: str,
    patience: int,
    lr_decay: float,
) -> EarlyStoppingDecision:
    """The decision after evaluating `metric` = `value` at `step` (see the module docstring)."""
    if is_improvement(value, record.best_metric, metric=metric):
        return EarlyStoppingDecision(
            "improved", replace(record, best_metric=value, best_step=step, bad_evals=0)
        )
    bad = replace(record, bad_evals=record.bad_evals + 1)
    if bad.bad_evals >= patience:
        return EarlyStoppingDecision("stop", bad)
    return EarlyStoppingDecision("decay", replace(bad, lr_factor=bad.lr_factor * lr_decay))
