"""The driver's running training AUC and logloss after every chunk of steps:
`BinaryMetricAccumulator.compute` (each chunk's scores sorted once and kept, the window's sort
merging those runs) against the window sorted again at every chunk, every sample's average rank
scattered back and the positives' gathered (`resorted`, the same figures by another way).

Chunks of `--chunk` samples (3 steps of 4096 by default) arrive into a window of `--window` samples
(`psrec.train.loop`'s 100,000); the two ways alternate chunk by chunk and the medians are printed.
Usage:

    python -m psrec.bench.running_auc_bench [--chunks 80] [--chunk 12288] [--window 100000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psrec.trainer.metrics import BinaryMetricAccumulator, logloss


def resorted(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    """AUC and logloss of the window in arrival order, the whole window sorted."""
    y, s = labels.astype(np.float64), scores.astype(np.float64)
    order = np.argsort(s, kind="mergesort")
    sorted_scores = s[order]
    starts_group = np.r_[True, sorted_scores[1:] != sorted_scores[:-1]]
    group = np.cumsum(starts_group) - 1
    starts = np.flatnonzero(starts_group)
    ends = np.r_[starts[1:], s.size]
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = ((starts + ends - 1) / 2 + 1)[group]
    positive = y > 0.5
    num_positive = int(positive.sum())
    num_negative = y.size - num_positive
    value = (ranks[positive].sum() - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative)
    return float(value), logloss(y, s)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=80)
    parser.add_argument("--chunk", type=int, default=12288)
    parser.add_argument("--window", type=int, default=100_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    accumulator = BinaryMetricAccumulator(window=args.window)
    labels: list[np.ndarray] = []
    scores: list[np.ndarray] = []
    kept, again = [], []
    for index in range(args.chunks):
        y = (rng.random(args.chunk) < 0.25).astype(np.float32)
        p = rng.random(args.chunk).astype(np.float32)
        accumulator.update(y, p)
        labels.append(y)
        scores.append(p)
        start = time.perf_counter()
        if index % 2:
            value, _ = resorted(
                np.concatenate(labels)[-args.window :], np.concatenate(scores)[-args.window :]
            )
            again.append(time.perf_counter() - start)
        else:
            value = accumulator.compute()["auc"]
            kept.append(time.perf_counter() - start)
        assert np.isfinite(value)
        while sum(part.size for part in labels[1:]) >= args.window:
            labels.pop(0)
            scores.pop(0)
    warm = args.chunks // 4
    print(f"sorted runs kept    {statistics.median(kept[warm:]) * 1e3:6.2f} ms")
    print(f"window sorted again {statistics.median(again[warm:]) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
