"""What the training driver knows of a run (`TrainState`): steps, epochs, the data consumed (the
exactly-once accounting of `psrec.train.accounting`), early-stopping records and bad-input counts.
Its JSON-able part travels in every checkpoint's `extra`; `roll_back` returns it to a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psrec.train.accounting import (
    EMPTY,
    id_ranges,
    ranges_from_json,
    ranges_size,
    ranges_to_json,
    union_ranges,
)
from psrec.trainer.chunks import ChunkResult

MAX_FAILED_UNITS = 100  # failed units listed in the summary (all are counted)


@dataclass
class TrainState:
    """What the driver knows of the run; the JSON-able part travels in every checkpoint's `extra`."""

    step: int = 0
    epoch: int = 0
    epoch_done: bool = False
    stopped: bool = False
    samples: int = 0
    rows_skipped: int = 0
    best_metric: float | None = None
    best_step: int = -1
    bad_evals: int = 0
    lr_factor: float = 1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    # bad input besides skipped rows: units failed, bytes and rows lost, dense values filled/clipped
    input_counts: dict[str, int] = field(default_factory=dict)
    failed_units: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_FAILED_UNITS
    # (step after the chunk, row ids the chunk consumed): the exact-once data accounting.
    consumed: list[tuple[int, np.ndarray]] = field(default_factory=list)
    rows_before_resume: int = 0
    # the ranges of every row consumed: the restored checkpoint's, with `consumed[:_folded]` added
    _ranges: np.ndarray = field(default_factory=lambda: EMPTY.copy())
    _folded: int = 0

    _SAVED = (
        "epoch",
        "epoch_done",
        "stopped",
        "samples",
        "rows_skipped",
        "best_metric",
        "best_step",
        "bad_evals",
        "lr_factor",
        "input_counts",
        "failed_units",
    )

    def add_chunk(self, results: list[ChunkResult]) -> None:
        """Count a chunk every trainer ran: its steps, samples, bad input and the rows it consumed."""
        self.step += results[0].steps
        for result in results:
            self.samples += result.samples
            self.rows_skipped += result.input_counts.get("rows_skipped", 0)
            for key, value in result.input_counts.items():
                if key != "rows_skipped":
                    self.input_counts[key] = self.input_counts.get(key, 0) + value
            self.failed_units += result.failed_units[: MAX_FAILED_UNITS - len(self.failed_units)]
        self.consumed.append((self.step, np.concatenate([result.row_ids for result in results])))

    def extra(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._SAVED} | {
            "history": self.history,
            "rows_consumed": self.rows_consumed(),
            "rows_consumed_ranges": ranges_to_json(self.consumed_ranges()),
        }

    def rows_consumed(self) -> int:
        return self.rows_before_resume + sum(ids.size for _, ids in self.consumed)

    def consumed_ranges(self) -> np.ndarray:
        """Every row id consumed by the run so far, before a restart included, as ranges."""
        new = [ids for _, ids in self.consumed[self._folded :]]
        if new:
            self._ranges = union_ranges(self._ranges, id_ranges(np.concatenate(new)))
            self._folded = len(self.consumed)
        return self._ranges

    def rows_consumed_unique(self) -> int:
        return ranges_size(self.consumed_ranges())

    def roll_back(self, step: int, extra: dict[str, Any]) -> None:
        """Return to a checkpoint: forget the work of steps after it."""
        fresh = TrainState()
        for key in self._SAVED:
            setattr(self, key, extra.get(key, getattr(fresh, key)))
        self.step = step
        self.history = list(extra.get("history", []))
        self.consumed = [(end, ids) for end, ids in self.consumed if end <= step]
        known = sum(ids.size for _, ids in self.consumed)
        self.rows_before_resume = int(extra.get("rows_consumed", known)) - known
        self._ranges, self._folded = ranges_from_json(extra.get("rows_consumed_ranges")), 0
