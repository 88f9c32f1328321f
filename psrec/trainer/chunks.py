"""A chunk of training steps (one `TrainerWorker.train_steps` call): what a trainer reports of it
(`ChunkResult`) and what it keeps while the chunk runs (`ChunkSoFar`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from psrec.trainer.step import StepResult


@dataclass
class ChunkResult:
    """What a trainer did in one `train_steps` call."""

    steps: int
    samples: int
    loss_sum: float  # sum over samples of the loss
    scores: np.ndarray
    labels: np.ndarray
    row_ids: np.ndarray  # global row indices consumed (exact-once accounting)
    exhausted: bool  # the epoch's data of this trainer is used up
    phase_seconds: dict[str, float]
    bytes_pulled: int
    bytes_pushed: int
    # since the previous chunk: malformed rows skipped, units not read to their end, bytes and rows
    # lost with them, dense values filled or clipped (`INPUT_COUNTS`), and the failed units themselves
    input_counts: dict[str, int] = field(default_factory=dict)
    failed_units: list[dict[str, Any]] = field(default_factory=list)
    first_step_at: float | None = None  # wall clock when the chunk's first step ended
    # where the trainer stands after it (`TrainerWorker.checkpoint_state`): step, epoch, reader position
    state: dict[str, Any] | None = None
    # a stream's lag after the chunk: {"events_behind", "newest_event_ms"} (None for files)
    stream: dict[str, Any] | None = None


@dataclass
class ChunkSoFar:
    """The steps of a chunk done so far (kept on the trainer, so a chunk a failure cut short still
    reports the steps it completed: `TrainerWorker.abort_chunk`)."""

    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    scores: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    row_ids: list[np.ndarray] = field(default_factory=list)
    first_step_at: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # the runner's phase times at its start
    pulled: int = 0
    pushed: int = 0

    def record(self, result: StepResult) -> None:
        """Add one training step's result."""
        self.steps += 1
        if self.first_step_at is None:
            self.first_step_at = time.time()
        n = result.labels.shape[0]
        if not n:
            return
        self.samples += n
        self.loss_sum += result.loss * n
        if result.scores.ndim == 2:  # ranking models: [positive, negative] logits per sample
            # sigmoid as exp(-log(1 + exp(-x))): no overflow for a masked negative's lowest logit
            self.scores.append(np.exp(-np.logaddexp(0.0, -result.scores.reshape(-1))))
            self.labels.append(np.tile(np.array([1.0, 0.0], np.float32), n))
        else:
            self.scores.append(result.scores)
            self.labels.append(result.labels)
        if result.row_ids is not None:
            self.row_ids.append(result.row_ids)
