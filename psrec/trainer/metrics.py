"""Evaluation metrics: AUC, logloss, GAUC, and ranking metrics HR@K, NDCG@K, MRR.

CTR metrics (labels y in {0, 1}, scores s; B samples):

- NaN labels are refused (ValueError) by every CTR metric.
- ``auc`` = P(s_pos > s_neg) + 0.5 P(s_pos = s_neg), computed exactly from average ranks
  (Mann-Whitney U): ``(sum of positive ranks - P (P + 1) / 2) / (P N)``. Equal to scikit-learn's
  ``roc_auc_score``. NaN when only one class is present.
- ``logloss`` = mean(-y log p - (1 - y) log(1 - p)) with p clipped to [1e-7, 1 - 1e-7] (the clip
  BARS/FuxiCTR use through scikit-learn's former default).
- ``gauc`` = sum_u w_u AUC_u / sum_u w_u with w_u = impressions of user u; users whose labels are all
  one class are skipped (their AUC is undefined).

Ranking metrics are computed from the 0-based rank r of the target item among its candidates
(r = number of competing items that outrank it): ``HR@K = mean(r < K)``,
``NDCG@K = mean(1[r < K] / log2(r + 2))`` (one relevant item, so the ideal DCG is 1),
``MRR = mean(1 / (r + 1))`` (``MRR@K`` sets 1 / (r + 1) to 0 when r >= K). Two protocols produce r:

- ``sampled_ranks(scores)``: a (B, C) matrix with the target in column 0 and C - 1 sampled negatives
  in the other columns (SASRec's 100 negatives: C = 101).
- ``full_ranks(scores, targets, seen)``: scores over all N items; items the user has already seen are
  masked out (never the target itself).

Ties: by default ``ties="pessimistic"``: a competitor whose score equals the target's counts as ranked
ahead of it, so a constant model gets the worst rank rather than a lucky one. ``ties="optimistic"``
counts only strictly greater scores. A NaN target score gets the worst rank.

Streaming: `BinaryMetricAccumulator` keeps the scores and labels it is given (exact over everything
seen, or over the last ``window`` samples) and computes AUC/logloss/GAUC on demand;
`RankingMetricAccumulator` keeps ranks. Memory is 12-20 bytes per sample; use ``window`` for very long
training runs.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

    ArrayLike = np.ndarray | torch.Tensor | Sequence[float]

Ties = Literal["pessimistic", "optimistic"]

LOGLOSS_EPSILON = 1e-7


def _as_numpy(values: ArrayLike, dtype: type = np.float64) -> np.ndarray:
    torch = sys.modules.get("torch")  # no tensor exists where torch is not imported (a Ray driver)
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.detach().to("cpu").numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)


def _check_labels(labels: np.ndarray, metric: str) -> None:
    """Refuse NaN labels: a NaN would silently count as a negative (auc) or poison the mean (logloss)."""
    missing = np.isnan(labels)
    if missing.any():
        raise ValueError(
            f"{metric}: {int(missing.sum())} of {labels.size} labels are NaN (first at index "
            f"{int(np.flatnonzero(missing)[0])}); labels must be 0 or 1: the data readers refuse other "
            "labels, so these came from elsewhere"
        )


def _positive_rank_sum(values: np.ndarray, positive: np.ndarray) -> float:
    """Sum of the 1-based ranks of `values` (ascending, ties sharing their average rank) where
    `positive`. Exact (half-integers) whatever the order of `values`; the stable sort runs in about
    linear time on values made of sorted runs (`BinaryMetricAccumulator` passes its chunks so)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], values.size]
    positives_before = np.r_[0, np.cumsum(positive[order], dtype=np.int64)]
    positives_per_tie = positives_before[ends] - positives_before[starts]
    return float((((starts + ends - 1) / 2 + 1) * positives_per_tie).sum())


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """ROC AUC of `scores` for binary `labels`; NaN when only one class is present."""
    y = _as_numpy(labels)
    s = _as_numpy(scores)
    if y.size != s.size:
        raise ValueError(f"auc: {y.size} labels but {s.size} scores")
    _check_labels(y, "auc")
    positive = y > 0.5
    num_positive = int(positive.sum())
    num_negative = y.size - num_positive
    if num_positive == 0 or num_negative == 0:
        return float("nan")
    rank_sum = _positive_rank_sum(s, positive)
    return float((rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative))


def logloss(labels: ArrayLike, probabilities: ArrayLike) -> float:
    """Mean binary cross-entropy of probabilities (not logits), clipped to [1e-7, 1 - 1e-7]."""
    y = _as_numpy(labels)
    p = np.clip(_as_numpy(probabilities), LOGLOSS_EPSILON, 1 - LOGLOSS_EPSILON)
    if y.size != p.size:
        raise ValueError(f"logloss: {y.size} labels but {p.size} probabilities")
    _check_labels(y, "logloss")
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def gauc(labels: ArrayLike, scores: ArrayLike, users: ArrayLike) -> float:
    """Impression-weighted mean of per-user AUC; users with a single class are skipped.

    NaN when no user has both classes.
    """
    y = _as_numpy(labels)
    s = _as_numpy(scores)
    u = _as_numpy(users, dtype=np.int64)
    if not y.size == s.size == u.size:
        raise ValueError(f"gauc: sizes differ: {y.size} labels, {s.size} scores, {u.size} users")
    _check_labels(y, "gauc")
    if y.size == 0:
        return float("nan")
    _, user_index = np.unique(u, return_inverse=True)
    order = np.lexsort((s, user_index))  # by user, then score
    sorted_user, sorted_score = user_index[order], s[order]
    num_users = int(user_index.max()) + 1
    # Rank within user: global average rank of (user, score) ties minus the user's start position.
    starts_group = np.r_[
        True, (sorted_user[1:] != sorted_user[:-1]) | (sorted_score[1:] != sorted_score[:-1])
    ]
    group = np.cumsum(starts_group) - 1
    starts = np.flatnonzero(starts_group)
    ends = np.r_[starts[1:], y.size]
    global_rank = ((starts + ends - 1) / 2 + 1)[group]  # 1-based
    counts = np.bincount(sorted_user, minlength=num_users)
    user_start = np.r_[0, np.cumsum(counts)[:-1]]
    rank_in_user = global_rank - user_start[sorted_user]
    positive = y[order] > 0.5
    num_positive = np.bincount(sorted_user, weights=positive, minlength=num_users)
    num_negative = counts - num_positive
    rank_sum = np.bincount(sorted_user, weights=rank_in_user * positive, minlength=num_users)
    valid = (num_positive > 0) & (num_negative > 0)
    if not valid.any():
        return float("nan")
    user_auc = (rank_sum[valid] - num_positive[valid] * (num_positive[valid] + 1) / 2) / (
        num_positive[valid] * num_negative[valid]
    )
    weights = counts[valid]
    return float((user_auc * weights).sum() / weights.sum())


def sampled_ranks(scores: np.ndarray | torch.Tensor, *, ties: Ties = "pessimistic") -> np.ndarray:
    """0-based rank (B,) of column 0 (the target) among the C columns of a (B, C) score matrix."""
    import torch

    s = torch.as_tensor(scores).detach()
    if s.ndim != 2 or s.shape[1] < 1:
        raise ValueError(f"sampled_ranks: scores must be (B, C) with C >= 1, got {tuple(s.shape)}")
    target = s[:, :1]  # (B, 1)
    others = s[:, 1:]  # (B, C - 1)
    beats = others >= target if ties == "pessimistic" else others > target
    ranks = beats.sum(dim=1)
    ranks = torch.where(torch.isnan(target[:, 0]), s.shape[1] - 1, ranks)
    return ranks.cpu().numpy().astype(np.int64)


def full_ranks(
    scores: np.ndarray | torch.Tensor,
    targets: np.ndarray | torch.Tensor,
    *,
    seen: np.ndarray | torch.Tensor | None = None,
    ties: Ties = "pessimistic",
) -> np.ndarray:
    """0-based rank (B,) of item ``targets[b]`` among all N items of a (B, N) score matrix.

    ``seen`` (B, N) bool marks items to exclude (the user's history, padding item 0, ...); the target
    column is never excluded, even when marked.
    """
    import torch

    s = torch.as_tensor(scores).detach()
    t = torch.as_tensor(targets, device=s.device).long().reshape(-1)
    if s.ndim != 2 or t.numel() != s.shape[0]:
        raise ValueError(
            f"full_ranks: scores must be (B, N) with B targets; got {tuple(s.shape)}, {t.numel()}"
        )
    rows = torch.arange(s.shape[0], device=s.device)
    target = s[rows, t].unsqueeze(1)  # (B, 1)
    beats = s >= target if ties == "pessimistic" else s > target  # (B, N)
    beats[rows, t] = False
    if seen is not None:
        beats &= ~torch.as_tensor(seen, device=s.device, dtype=torch.bool)
    ranks = beats.sum(dim=1)
    ranks = torch.where(torch.isnan(target[:, 0]), s.shape[1] - 1, ranks)
    return ranks.cpu().numpy().astype(np.int64)


def hit_rate(ranks: np.ndarray, k: int) -> float:
    """HR@K: fraction of targets ranked in the top K."""
    return float(np.mean(np.asarray(ranks) < k))


def ndcg(ranks: np.ndarray, k: int) -> float:
    """NDCG@K with one relevant item: mean of 1 / log2(rank + 2) over targets in the top K."""
    r = np.asarray(ranks, dtype=np.float64)
    return float(np.mean(np.where(r < k, 1.0 / np.log2(r + 2), 0.0)))


def mrr(ranks: np.ndarray, k: int | None = None) -> float:
    """Mean reciprocal rank; with `k`, reciprocal ranks beyond the top K count as 0."""
    r = np.asarray(ranks, dtype=np.float64)
    reciprocal = 1.0 / (r + 1)
    if k is not None:
        reciprocal = np.where(r < k, reciprocal, 0.0)
    return float(np.mean(reciprocal))


def ranking_metrics(ranks: np.ndarray, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """{"hr@K", "ndcg@K" for each K, "mrr"} from 0-based target ranks."""
    out: dict[str, float] = {}
    for k in ks:
        out[f"hr@{k}"] = hit_rate(ranks, k)
        out[f"ndcg@{k}"] = ndcg(ranks, k)
    out["mrr"] = mrr(ranks)
    return out


class BinaryMetricAccumulator:
    """Running AUC / logloss (and GAUC when user ids are given) over a training or evaluation pass.

    Exact: it keeps every (label, probability[, user]) it is given, or only the last `window` samples
    when `window` is set (a bounded, sliding estimate for long training runs).
    """

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive or None, got {window}")
        self.window = window
        self._chunks: deque[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = deque()
        # Each chunk's (labels, probabilities) sorted by probability, made at its first `compute`:
        # the AUC's sort then merges sorted runs instead of sorting the whole window again.
        self._runs: deque[tuple[np.ndarray, np.ndarray] | None] = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def update(self, labels: ArrayLike, probabilities: ArrayLike, users: ArrayLike | None = None) -> None:
        y = _as_numpy(labels, np.float32)
        p = _as_numpy(probabilities, np.float32)
        u = None if users is None else _as_numpy(users, np.int64)
        if y.size != p.size or (u is not None and u.size != y.size):
            raise ValueError("BinaryMetricAccumulator.update: labels, probabilities and users differ in size")
        if self._chunks and (u is None) != (self._chunks[0][2] is None):
            raise ValueError("BinaryMetricAccumulator.update: give users with every update or with none")
        self._chunks.append((y, p, u))
        self._runs.append(None)
        self._size += y.size
        while self.window is not None and self._size - self._chunks[0][0].size >= self.window:
            self._size -= self._chunks.popleft()[0].size
            self._runs.popleft()

    def compute(self) -> dict[str, float]:
        """{"auc", "logloss", "count"[, "gauc"]} over the kept samples (the last `window` exactly)."""
        if not self._chunks:
            return {"auc": float("nan"), "logloss": float("nan"), "count": 0.0}
        y = np.concatenate([chunk[0] for chunk in self._chunks])
        p = np.concatenate([chunk[1] for chunk in self._chunks])
        start = 0 if self.window is None else max(0, y.size - self.window)
        y, p = y[start:], p[start:]
        runs = []
        for index, chunk in enumerate(self._chunks):
            run = self._runs[index]
            if run is None:
                run = self._runs[index] = _by_probability(chunk[0], chunk[1])
            runs.append(run)
        if start:  # only the first chunk is cut (update drops whole chunks)
            first = self._chunks[0]
            runs[0] = _by_probability(first[0][start:], first[1][start:])
        by_score = (np.concatenate([run[0] for run in runs]), np.concatenate([run[1] for run in runs]))
        out = {"auc": auc(*by_score), "logloss": logloss(y, p), "count": float(y.size)}
        if self._chunks[0][2] is not None:
            users = np.concatenate([chunk[2] for chunk in self._chunks if chunk[2] is not None])[start:]
            out["gauc"] = gauc(y, p, users)
        return out

    def reset(self) -> None:
        self._chunks.clear()
        self._runs.clear()
        self._size = 0


def _by_probability(labels: np.ndarray, probabilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(probabilities, kind="stable")
    return labels[order], probabilities[order]


class RankingMetricAccumulator:
    """Collects 0-based target ranks over an evaluation pass and reports `ranking_metrics`."""

    def __init__(self, ks: Sequence[int] = (1, 5, 10)) -> None:
        self.ks = tuple(ks)
        self._ranks: list[np.ndarray] = []

    def update(self, ranks: np.ndarray) -> None:
        self._ranks.append(np.asarray(ranks, dtype=np.int64).reshape(-1))

    def compute(self) -> dict[str, float]:
        if not self._ranks:
            return {"count": 0.0}
        ranks = np.concatenate(self._ranks)
        return {**ranking_metrics(ranks, self.ks), "count": float(ranks.size)}

    def reset(self) -> None:
        self._ranks.clear()
