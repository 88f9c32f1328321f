"""What a trainer (`psrec.trainer.worker.TrainerWorker`) needs of its step runner: the `Runner` protocol.

Two runners implement it: `psrec.trainer.step.StepRunner` (one trainer's whole model, with a planner
thread reading ahead) and `psrec.trainer.pipeline_step.PipelineStepRunner` (one stage of a pipelined
dense model, with ``ps.pipeline``). The worker calls only these members, so it never asks which
runner it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from psrec.data.batch import Batch
from psrec.trainer.step import PhaseTimer, StepResult


class Runner(Protocol):
    """A trainer's step runner (see the module docstring)."""

    @property
    def timer(self) -> PhaseTimer:
        """Cumulative seconds by phase (the worker reports each chunk's difference)."""
        ...

    @property
    def trained_position(self) -> Any:
        """The reader's position after the last batch trained on, or None: then the reader's own
        position is the trained one (a runner that does not read ahead, or nothing trained yet)."""
        ...

    def run(
        self,
        batches: Iterator[Batch],
        *,
        first_step: int,
        max_steps: int,
        position: Callable[[], Any] | None = None,
    ) -> Iterator[StepResult]:
        """Train up to `max_steps` steps from `batches`, yielding one result per step; `position`
        gives the reader's position (for runners that record `trained_position`)."""
        ...

    def close(self) -> None:
        """Stop any read-ahead of the current reader (before that reader is closed or replaced)."""
        ...

    def flush(self) -> None:
        """Wait for every outstanding push (before evaluation or a checkpoint)."""
        ...

    def predict(self, batch: Batch) -> np.ndarray:
        """Scores of `batch` without training or growing any table."""
        ...
