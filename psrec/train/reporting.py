"""TensorBoard summaries of a run: one writer in RUN_DIR/tensorboard, scalars by prefix and step.

The driver (`psrec.train.loop`) writes its progress reports under ``train/`` and each validation
evaluation under ``validation/``. Without TensorBoard installed the writer is None and nothing is
written. View with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _tensorboard_classes() -> tuple[Any, Any, Any] | None:
    """TensorBoard's `Event` and `Summary` protos and its `EventFileWriter`, or None without TensorBoard.

    The writer writes local files only (a run directory in a store gets them uploaded by the driver),
    so TensorBoard is imported without its S3 support: its file layer imports boto3 when it can,
    which was 0.2-0.3 s of the run's start-up (docs/benchmarks.md, "Start-up"). A boto3 already
    imported stays TensorBoard's; psrec's own S3 file system imports boto3 later as before.
    """
    blocked = "boto3" not in sys.modules
    if blocked:
        sys.modules["boto3"] = None  # type: ignore[assignment]  # `import boto3` raises ImportError
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:  # pragma: no cover - tensorboard is a dependency
        return None
    finally:
        if blocked:
            del sys.modules["boto3"]
    return Event, Summary, EventFileWriter


# Imported with this module (0.12-0.14 s): `psrec train` on Ray imports the driver's code, this module
# included, while Ray starts (`psrec.cluster.start.start_ray_importing`), not once its actors are up.
_TENSORBOARD = _tensorboard_classes()


class ScalarWriter:
    """Scalars into one TensorBoard event file, written by TensorBoard's own `EventFileWriter` (the
    writer `torch.utils.tensorboard.SummaryWriter` wraps, and the same records: ``simple_value``
    summaries, the same file name, queue and flush interval), without importing torch: the driver of
    a Ray run starts its cluster and actors without torch, and trains to the end without it."""

    def __init__(self, directory: Path) -> None:
        assert _TENSORBOARD is not None
        self._event, self._summary, event_file_writer = _TENSORBOARD
        self._writer = event_file_writer(str(directory))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(summary=summary, wall_time=time.time(), step=int(step)))

    def close(self) -> None:
        self._writer.close()


def summary_writer(run_dir: Path) -> ScalarWriter | None:
    """A TensorBoard writer into RUN_DIR/tensorboard, or None without TensorBoard."""
    return ScalarWriter(run_dir / "tensorboard") if _TENSORBOARD is not None else None


def write_scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
    """Every finite number of `values` as ``PREFIX/KEY`` at `step` (but "step" and "epoch" themselves)."""
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, float | int) and key not in ("step", "epoch") and np.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)
