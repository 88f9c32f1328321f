import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from psrec.trainer.metrics import (
    BinaryMetricAccumulator,
    RankingMetricAccumulator,
    auc,
    full_ranks,
    gauc,
    hit_rate,
    logloss,
    mrr,
    ndcg,
    ranking_metrics,
    sampled_ranks,
)


def test_auc_hand_computed() -> None:
    # positives 0.8, 0.4; negatives 0.5, 0.4: pairs (0.8>0.5, 0.8>0.4, 0.4<0.5, 0.4=0.4 -> 0.5) = 2.5/4
    assert auc([1, 0, 1, 0], [0.8, 0.5, 0.4, 0.4]) == pytest.approx(0.625)


@pytest.mark.parametrize("seed", range(3))
def test_auc_and_logloss_match_sklearn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 500)
    scores = np.round(rng.random(500), 2)  # many ties
    assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    probabilities = np.clip(scores, 0.01, 0.99)
    assert logloss(labels, probabilities) == pytest.approx(log_loss(labels, probabilities), abs=1e-12)


def test_auc_accepts_torch_and_is_nan_for_one_class() -> None:
    assert auc(torch.tensor([0.0, 1.0]), torch.tensor([0.1, 0.9])) == 1.0
    assert math.isnan(auc([1, 1], [0.1, 0.2]))


def test_ctr_metrics_refuse_nan_labels() -> None:
    """A NaN label would count as a negative in auc and make logloss NaN: refused, with where."""
    labels = [1.0, float("nan"), 0.0, 1.0]
    with pytest.raises(ValueError, match=r"auc: 1 of 4 labels are NaN \(first at index 1\)"):
        auc(labels, [0.9, 0.2, 0.1, 0.8])
    with pytest.raises(ValueError, match=r"logloss: 1 of 4 labels are NaN"):
        logloss(labels, [0.9, 0.2, 0.1, 0.8])
    with pytest.raises(ValueError, match=r"gauc: 1 of 4 labels are NaN"):
        gauc(labels, [0.9, 0.2, 0.1, 0.8], [1, 1, 2, 2])
    accumulator = BinaryMetricAccumulator()
    accumulator.update(torch.tensor(labels), torch.tensor([0.9, 0.2, 0.1, 0.8]))
    with pytest.raises(ValueError, match="labels are NaN"):
        accumulator.compute()


def test_logloss_clips_probabilities() -> None:
    assert logloss([1, 0], [0.0, 1.0]) == pytest.approx(-math.log(1e-7))


def test_gauc_matches_per_user_loop() -> None:
    rng = np.random.default_rng(0)
    users = rng.integers(0, 30, 600) * 7 + 3  # non-contiguous ids
    labels = rng.integers(0, 2, 600)
    scores = np.round(rng.random(600), 1)
    total, weight = 0.0, 0
    for user in np.unique(users):
        rows = users == user
        if len(np.unique(labels[rows])) < 2:
            continue
        total += roc_auc_score(labels[rows], scores[rows]) * rows.sum()
        weight += rows.sum()
    assert gauc(labels, scores, users) == pytest.approx(total / weight, abs=1e-12)


def test_gauc_skips_single_class_users() -> None:
    # user 1: perfect (weight 2); user 2: reversed (weight 2); user 3: only positives, skipped.
    labels = [1, 0, 1, 0, 1, 1, 1]
    scores = [0.9, 0.1, 0.1, 0.9, 0.5, 0.6, 0.7]
    users = [1, 1, 2, 2, 3, 3, 3]
    assert gauc(labels, scores, users) == pytest.approx(0.5)
    assert math.isnan(gauc([1, 1], [0.1, 0.2], [5, 5]))


def test_sampled_ranks_and_ties() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.5, 0.5, 0.9], [0.1, 0.2, 0.3], [float("nan"), 0.0, 0.0]])
    assert sampled_ranks(scores).tolist() == [0, 2, 2, 2]
    assert sampled_ranks(scores, ties="optimistic").tolist() == [0, 1, 2, 2]
    constant = np.zeros((5, 101))
    assert hit_rate(sampled_ranks(constant), 10) == 0.0


def test_ranking_metrics_hand_computed() -> None:
    ranks = np.array([0, 1, 4, 20])
    assert hit_rate(ranks, 5) == 0.75
    assert ndcg(ranks, 5) == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(6)) / 4)
    assert mrr(ranks) == pytest.approx((1 + 1 / 2 + 1 / 5 + 1 / 21) / 4)
    assert mrr(ranks, k=5) == pytest.approx((1 + 1 / 2 + 1 / 5) / 4)
    metrics = ranking_metrics(ranks, ks=(1, 10))
    assert set(metrics) == {"hr@1", "ndcg@1", "hr@10", "ndcg@10", "mrr"}
    assert metrics["hr@1"] == metrics["ndcg@1"] == 0.25


def test_full_ranks_masks_seen_items_but_not_target() -> None:
    scores = torch.tensor([[0.0, 0.9, 0.8, 0.7, 0.1], [0.0, 0.2, 0.3, 0.4, 0.5]])
    targets = torch.tensor([3, 1])
    assert full_ranks(scores, targets).tolist() == [2, 3]
    seen = torch.zeros(2, 5, dtype=torch.bool)
    seen[0, 1] = True  # seen item outranking the target: excluded
    seen[1, 1] = True  # the target itself marked seen: still ranked
    seen[1, 4] = True
    assert full_ranks(scores, targets, seen=seen).tolist() == [1, 2]


def test_full_ranks_agree_with_sampled_ranks() -> None:
    rng = np.random.default_rng(1)
    scores = rng.random((6, 9))
    targets = rng.integers(0, 9, 6)
    sampled = np.concatenate([scores[np.arange(6), targets][:, None], scores], axis=1)
    sampled[np.arange(6), targets + 1] = -np.inf  # the target's own column among the others
    assert full_ranks(scores, targets).tolist() == sampled_ranks(sampled).tolist()


def test_binary_accumulator_exact_and_windowed() -> None:
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, 1000)
    probabilities = rng.random(1000) * 0.98 + 0.01
    users = rng.integers(0, 10, 1000)
    exact = BinaryMetricAccumulator()
    windowed = BinaryMetricAccumulator(window=300)
    for start in range(0, 1000, 128):
        part = slice(start, start + 128)
        exact.update(labels[part], torch.tensor(probabilities[part]), users=users[part])
        windowed.update(labels[part], probabilities[part], users=users[part])
    result = exact.compute()
    assert result["count"] == 1000
    assert result["auc"] == pytest.approx(roc_auc_score(labels, probabilities), abs=1e-6)
    assert result["logloss"] == pytest.approx(log_loss(labels, probabilities), abs=1e-6)
    assert result["gauc"] == pytest.approx(gauc(labels, probabilities, users), abs=1e-6)
    last = windowed.compute()
    assert last["count"] == 300
    assert last["auc"] == pytest.approx(roc_auc_score(labels[-300:], probabilities[-300:]), abs=1e-6)
    exact.reset()
    assert exact.compute()["count"] == 0
    with pytest.raises(ValueError, match="users"):
        windowed.update([1], [0.5])


def test_windowed_auc_computed_after_every_update_is_that_of_the_last_window() -> None:
    """Computed after each update (chunks sorted once and kept, the oldest cut inside a chunk, ties):
    the AUC of exactly the last `window` samples in arrival order, equal to `auc` on them bit for bit
    and to scikit-learn's."""
    rng = np.random.default_rng(7)
    windowed = BinaryMetricAccumulator(window=500)
    labels, probabilities = [], []
    for size in rng.integers(1, 200, 40):
        y = rng.integers(0, 2, size).astype(np.float32)
        p = np.round(rng.random(size), 2).astype(np.float32)  # many ties
        labels.append(y)
        probabilities.append(p)
        windowed.update(y, p)
        y_all, p_all = np.concatenate(labels)[-500:], np.concatenate(probabilities)[-500:]
        got = windowed.compute()
        assert got["count"] == y_all.size
        if 0 < y_all.sum() < y_all.size:
            assert got["auc"] == auc(y_all, p_all)
            assert got["auc"] == pytest.approx(roc_auc_score(y_all, p_all), abs=1e-12)


def test_ranking_accumulator() -> None:
    accumulator = RankingMetricAccumulator(ks=(10,))
    accumulator.update(np.array([0, 20]))
    accumulator.update(np.array([9]))
    result = accumulator.compute()
    assert result["hr@10"] == pytest.approx(2 / 3)
    assert result["count"] == 3
