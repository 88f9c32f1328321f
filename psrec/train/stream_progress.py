"""What a continuous run reports as it goes: lag behind the stream's head and progressive validation.

Lag, after each chunk of steps, summed over the trainers' partitions:

- ``events_behind``: messages between the readers' positions and the partitions' ends as the last
  fetch saw them (the standard consumer lag); ``files_behind``: for growing files, the files listed
  and not read yet;
- ``seconds_behind``: how old the newest event trained on is (now minus its timestamp) while events
  wait, 0 when none does (the model has everything the stream holds).

Progressive validation (the metric of online learning in ads): every event is scored by the model
before the model trains on it (a training step's forward pass comes before its update), so the AUC
and logloss of the training scores over the last ``window`` events measure the model on events it has
not seen. Reported as ``progressive_auc`` / ``progressive_logloss``.

The driver (`psrec.train.loop`) sends each point to the progress callback and TensorBoard ("stream/")
and keeps the last `MAX_POINTS` for `summary.json`'s ``stream`` section.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from psrec.trainer.metrics import BinaryMetricAccumulator

MAX_POINTS = 1000  # the summary keeps the last points (TensorBoard has every one)


class StreamProgress:
    """Lag and progressive validation of a continuous run (see the module docstring)."""

    def __init__(self, *, window: int) -> None:
        self.metrics = BinaryMetricAccumulator(window=window)  # the driver feeds it each chunk's scores
        self.points: deque[dict[str, Any]] = deque(maxlen=MAX_POINTS)
        self.last: dict[str, Any] = {}

    def after_chunk(
        self, lags: list[dict[str, Any]], *, step: int, samples: int, now: float | None = None
    ) -> dict[str, Any]:
        """The point after a chunk: `lags` are the trainers' `ChunkResult.stream` reports."""
        now = time.time() if now is None else now
        events_behind = sum(int(lag.get("events_behind", 0)) for lag in lags)
        files_behind = sum(int(lag.get("files_behind", 0)) for lag in lags)
        newest = max((int(lag.get("newest_event_ms", -1)) for lag in lags), default=-1)
        waiting = events_behind or files_behind
        seconds_behind = max(0.0, now - newest / 1000) if waiting and newest >= 0 else 0.0
        metrics = self.metrics.compute() if len(self.metrics) else {}
        point = {
            "time": now,
            "step": step,
            "samples": samples,
            "events_behind": events_behind,
            "files_behind": files_behind,
            "seconds_behind": seconds_behind,
            "newest_event_ms": newest,
            "progressive_auc": float(metrics.get("auc", float("nan"))),
            "progressive_logloss": float(metrics.get("logloss", float("nan"))),
        }
        self.points.append(point)
        self.last = point
        return point

    def summary(self, positions: list[Any]) -> dict[str, Any]:
        """`summary.json`'s ``stream``: the last lag and metrics, the recent points, where each
        trainer's reader stands."""
        return {
            **{k: v for k, v in self.last.items() if k not in ("time", "step", "samples")},
            "metrics_window": self.metrics.window,
            "positions": positions,
            "points": list(self.points),
        }
