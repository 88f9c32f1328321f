"""TensorBoard summaries of a run: one writer in RUN_DIR/tensorboard, scalars by prefix and step.

The driver (`psrec.train.loop`) writes its progress reports under ``train/`` and each validation
evaluation under ``validation/``. Without TensorBoard installed the writer is None and nothing is
written. View with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def summary_writer(run_dir: Path) -> Any:
    """A TensorBoard `SummaryWriter` into RUN_DIR/tensorboard, or None without TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # pragma: no cover - tensorboard is a dependency
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def write_scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
    """Every finite number of `values` as ``PREFIX/KEY`` at `step` (but "step" and "epoch" themselves)."""
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, float | int) and key not in ("step", "epoch") and np.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)
