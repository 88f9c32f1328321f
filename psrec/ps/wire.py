"""Compact wire format between trainers and shard actors (`ps.wire_precision`).

``fp32`` sends rows and gradients as they are. ``fp16`` halves what crosses the wire:

- pulled **rows** travel as float16 (embedding values are far inside its range; |w| is clipped to
  65,504), and the trainer widens them back to float32;
- pushed **gradients** travel as float16 with one float32 scale per row (the row's largest magnitude
  / 2**15), so a row's gradient keeps float16's 11 significant bits whatever its magnitude; a plain
  float16 cast would flush the tiny gradients of rare ids (below ~6e-8) to zero.

Only the bytes on the wire change: the shards still store rows at their table precision and apply
float32 updates. In-process shards never serialise, so the client ignores the setting there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WIRE_PRECISIONS = ("fp32", "fp16")
_FP16_MAX = np.float32(np.finfo(np.float16).max)
_GRADIENT_RANGE = np.float32(2.0**15)


@dataclass(frozen=True)
class ScaledFp16:
    """(n, d) float16 values and (n,) float32 scales: row i is ``values[i] * scales[i]``."""

    values: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)


def check_precision(precision: str) -> None:
    if precision not in WIRE_PRECISIONS:
        raise ValueError(f"wire precision must be one of {WIRE_PRECISIONS}, got {precision!r}")


def encode_rows(rows: np.ndarray, precision: str) -> np.ndarray:
    """Rows as sent by a shard: float32, or float16 (clipped to its range)."""
    if precision == "fp32":
        return rows
    return np.clip(rows, -_FP16_MAX, _FP16_MAX).astype(np.float16)


def decode_rows(rows: np.ndarray) -> np.ndarray:
    """Rows as received by a trainer, float32 whatever the wire precision."""
    return rows if rows.dtype == np.float32 else rows.astype(np.float32)


def encode_gradients(grads: np.ndarray, precision: str) -> np.ndarray | ScaledFp16:
    """(n, d) float32 gradients as sent by a trainer."""
    if precision == "fp32":
        return grads
    peak = np.abs(grads).max(axis=1) if grads.shape[1] else np.zeros(grads.shape[0], np.float32)
    scales = np.where(peak > 0, peak / _GRADIENT_RANGE, np.float32(1.0)).astype(np.float32)
    return ScaledFp16((grads / scales[:, None]).astype(np.float16), scales)


def decode_gradients(grads: np.ndarray | ScaledFp16) -> np.ndarray:
    """Gradients as received by a shard: (n, d) float32."""
    if isinstance(grads, ScaledFp16):
        return np.ascontiguousarray(grads.values.astype(np.float32) * grads.scales[:, None])
    return grads
