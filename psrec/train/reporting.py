"""TensorBoard summaries of a run: one writer in RUN_DIR/tensorboard, scalars by prefix and step.

The driver (`psrec.train.loop`) writes its progress reports under ``train/`` and each validation
evaluation under ``validation/``. Without TensorBoard installed the writer is None and nothing is
written. View with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np


def summary_writer(run_dir: Path) -> Any:
    """A TensorBoard `SummaryWriter` into RUN_DIR/tensorboard, or None without TensorBoard.

    The writer writes local files only (a run directory in a store gets them uploaded by the driver),
    so TensorBoard is imported without its S3 support: its file layer imports boto3 when it can,
    which was 0.2-0.3 s of the run's start-up (docs/benchmarks.md, "Start-up"). A boto3 already
    imported stays TensorBoard's; psrec's own S3 file system imports boto3 later as before.
    """
    blocked = "boto3" not in sys.modules
    if blocked:
        sys.modules["boto3"] = None  # type: ignore[assignment]  # `import boto3` raises ImportError
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # pragma: no cover - tensorboard is a dependency
        return None
    finally:
        if blocked:
            del sys.modules["boto3"]
    return SummaryWriter(str(run_dir / "tensorboard"))


def write_scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
    """Every finite number of `values` as ``PREFIX/KEY`` at `step` (but "step" and "epoch" themselves)."""
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, float | int) and key not in ("step", "epoch") and np.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)
