"""Deterministic initial rows: a pure function of (table seed, id, column).

This is what lets a sharded run equal a single-process run: an id gets the same initial row on any
shard and in any arrival order, without storing anything for ids that were never admitted.

For an id ``k`` the base hash is ``b = hash_key(k, seed)``; column ``j`` draws the 24-bit uniform
``u_j = (mix64(b + (j + 1) * GOLDEN_GAMMA) >> 40) / 2**24`` in [0, 1).

- ``uniform``: ``scale * (2 u_j - 1)``.
- ``normal``: Box-Muller on the pair of columns (2m, 2m+1): ``r = sqrt(-2 ln(1 - u_2m))``,
  column 2m gets ``std * r * cos(2 pi u_{2m+1})`` and column 2m+1 ``std * r * sin(2 pi u_{2m+1})``.
- ``zeros``: 0.

The kernel ``initial_rows`` computes in float32 (twice as fast as float64 transcendental calls);
its NumPy oracle ``initial_rows_numpy`` computes in float64, so the two agree to float32 rounding.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from psrec.embedding.hashing import (
    GOLDEN_GAMMA,
    hash_key,
    hash_key_numpy,
    mix64,
    mix64_numpy,
)
from psrec.embedding.specs import InitializerSpec

INITIALIZER_CODES = {"zeros": 0, "uniform": 1, "normal": 2}
INITIALIZER_DOMAIN = 0x1D1E_0001
TWO_PI = 2.0 * math.pi
UNIT24 = 1.0 / float(1 << 24)


def derived_seed(seed: int, domain: int) -> int:
    """A 64-bit seed for one use (``domain``) of the table seed."""
    return (seed * GOLDEN_GAMMA + domain) % (1 << 64)


@numba.njit(cache=True, nogil=True, inline="always")
def _uniform24(hash_value):  # pragma: no cover - numba
    return np.float32(hash_value >> np.uint64(40)) * np.float32(UNIT24)


@numba.njit(cache=True, nogil=True)
def _initial_rows_kernel(ids, rows, out, kind, std, scale, seed):  # pragma: no cover - numba
    """out[rows[i]] = the initial row of ids[i]."""
    dim = out.shape[1]
    gamma = np.uint64(GOLDEN_GAMMA)
    for i in range(ids.shape[0]):
        target = out[rows[i]]
        if kind == 0:
            for j in range(dim):
                target[j] = 0.0
            continue
        base = hash_key(ids[i], seed)
        if kind == 1:
            for j in range(dim):
                u = _uniform24(mix64(base + np.uint64(j + 1) * gamma))
                target[j] = scale * (np.float32(2.0) * u - np.float32(1.0))
            continue
        for j in range(0, dim, 2):
            u_radius = _uniform24(mix64(base + np.uint64(j + 1) * gamma))
            u_angle = _uniform24(mix64(base + np.uint64(j + 2) * gamma))
            radius = std * np.sqrt(np.float32(-2.0) * np.log(np.float32(1.0) - u_radius))
            angle = np.float32(TWO_PI) * u_angle
            target[j] = radius * np.cos(angle)
            if j + 1 < dim:
                target[j + 1] = radius * np.sin(angle)


def write_initial_rows(
    out: np.ndarray, rows: np.ndarray, ids: np.ndarray, spec: InitializerSpec, seed: int
) -> None:
    """``out[rows[i]] = `` the initial row of ``ids[i]``, written in place (e.g. straight into a
    table's float32 storage: no temporary rows and no second copy). `out` is C-contiguous float32."""
    if out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous 2-D float32 array, got {out.dtype} {out.shape}")
    if rows.shape != ids.shape:
        raise ValueError(f"rows {rows.shape} and ids {ids.shape} must have the same shape")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= out.shape[0]):
        raise IndexError(f"rows must lie in [0, {out.shape[0]})")
    if ids.shape[0]:
        _initial_rows_kernel(
            ids,
            rows,
            out,
            INITIALIZER_CODES[spec.kind],
            np.float32(spec.std),
            np.float32(spec.scale),
            np.uint64(derived_seed(seed, INITIALIZER_DOMAIN)),
        )


def initial_rows(ids: np.ndarray, dim: int, spec: InitializerSpec, seed: int) -> np.ndarray:
    """(len(ids), dim) float32 initial rows (numba)."""
    out = np.empty((ids.shape[0], dim), dtype=np.float32)
    write_initial_rows(out, np.arange(ids.shape[0]), ids, spec, seed)
    return out


def initial_rows_numpy(ids: np.ndarray, dim: int, spec: InitializerSpec, seed: int) -> np.ndarray:
    """NumPy oracle of ``initial_rows``."""
    if spec.kind == "zeros":
        return np.zeros((ids.shape[0], dim), dtype=np.float32)
    base = hash_key_numpy(ids, derived_seed(seed, INITIALIZER_DOMAIN))[:, None]  # (n, 1)
    with np.errstate(over="ignore"):
        offsets = (np.arange(1, dim + 2, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA))[None, :]
        uniforms = (mix64_numpy(base + offsets) >> np.uint64(40)).astype(np.float64) * UNIT24  # (n, dim + 1)
    if spec.kind == "uniform":
        return (spec.scale * (2.0 * uniforms[:, :dim] - 1.0)).astype(np.float32)
    out = np.empty((ids.shape[0], dim), dtype=np.float64)
    radius = np.sqrt(-2.0 * np.log(1.0 - uniforms[:, 0:dim:2]))
    angle = TWO_PI * uniforms[:, 1 : dim + 1 : 2]
    out[:, 0::2] = spec.std * radius * np.cos(angle)
    out[:, 1::2] = (spec.std * radius * np.sin(angle))[:, : dim // 2]
    return out.astype(np.float32)
