"""Row storage at a chosen precision: fp32, fp16, or int8 with a per-row scale and offset.

Optimizer math always runs in fp32: low-precision rows are decoded into an fp32 scratch, updated,
and re-encoded. Encoding rounds to nearest (ties to even for fp16) or, with stochastic rounding,
up or down with probability proportional to the distance, using a hash of (seed, id, step, column)
as the random number so results are reproducible and independent of shard and thread.

- ``fp16``: IEEE half stored as float16 (2 bytes per value). The numba kernels work on the raw bits
  (uint16/uint32 views); ``np.float16`` casts are the oracle in the tests.
- ``int8``: uint8 codes ``q`` with ``value = q * scale + offset``, ``offset = min(row)``,
  ``scale = (max(row) - min(row)) / 255`` (``scale = 0`` for a constant row): D + 8 bytes per row.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from psrec.embedding.arrays import grow_rows
from psrec.embedding.hashing import GOLDEN_GAMMA, hash_key, mix64, unit_float
from psrec.embedding.prefetch import prefetch, prefetch_row

INT8_LEVELS = 255.0
PREFETCH_DISTANCE = 16
ROUNDING_DOMAIN = 0x5707_0001


@numba.njit(cache=True, nogil=True, inline="always")
def _half_bits_nearest(bits):  # pragma: no cover - numba
    """Round-to-nearest-even float32 bits -> float16 bits (in a uint32)."""
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    if magnitude >= np.uint32(0x7F800000):
        nan_bit = np.uint32(0x200) if magnitude > np.uint32(0x7F800000) else np.uint32(0)
        return sign | np.uint32(0x7C00) | nan_bit
    if magnitude >= np.uint32(0x477FF000):
        return sign | np.uint32(0x7C00)
    if magnitude >= np.uint32(0x38800000):
        odd = (magnitude >> np.uint32(13)) & np.uint32(1)
        magnitude = magnitude + np.uint32(0xFFF) + odd
        return sign | ((magnitude - np.uint32(112 << 23)) >> np.uint32(13))
    if magnitude <= np.uint32(0x33000000):
        return sign
    exponent = magnitude >> np.uint32(23)
    mantissa = (magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    shift = np.uint32(126) - exponent
    result = mantissa >> shift
    remainder = mantissa & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    if remainder > half or (remainder == half and (result & np.uint32(1)) == np.uint32(1)):
        result += np.uint32(1)
    return sign | result


@numba.njit(cache=True, nogil=True, inline="always")
def _half_value(half):  # pragma: no cover - numba
    """float16 bits -> value (float64); finite inputs only."""
    exponent = (half >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = float(half & np.uint32(0x3FF))
    if exponent == 0:
        value = mantissa * 2.0**-24
    else:
        value = (1.0 + mantissa / 1024.0) * 2.0 ** (float(exponent) - 15.0)
    return -value if (half & np.uint32(0x8000)) != 0 else value


@numba.njit(cache=True, nogil=True, inline="always")
def _float_bits_of_half(half):  # pragma: no cover - numba
    """float16 bits -> float32 bits (exact)."""
    sign = (half & np.uint32(0x8000)) << np.uint32(16)
    exponent = (half >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = half & np.uint32(0x3FF)
    if exponent == np.uint32(0x1F):
        return sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13))
    if exponent == 0:
        if mantissa == 0:
            return sign
        shift = np.uint32(0)
        while (mantissa & np.uint32(0x400)) == 0:
            mantissa <<= np.uint32(1)
            shift += np.uint32(1)
        mantissa &= np.uint32(0x3FF)
        return sign | ((np.uint32(113) - shift) << np.uint32(23)) | (mantissa << np.uint32(13))
    return sign | ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))


@numba.njit(cache=True, nogil=True, inline="always")
def _rounding_base(key, seed, step):
    return hash_key(key, seed ^ mix64(np.uint64(step) + np.uint64(GOLDEN_GAMMA)))


@numba.njit(cache=True, nogil=True, inline="always")
def _rounding_uniform(base, column):
    return unit_float(mix64(base + np.uint64(column + 1) * np.uint64(GOLDEN_GAMMA)))


@numba.njit(cache=True, nogil=True)
def _fp16_encode_kernel(values, value_bits, storage, rows, stochastic, ids, seed, step):  # pragma: no cover
    dim = values.shape[1]
    for i in range(values.shape[0]):
        base = _rounding_base(ids[i], seed, step) if stochastic else np.uint64(0)
        target = storage[rows[i]]
        for j in range(dim):
            half = _half_bits_nearest(value_bits[i, j])
            value = float(values[i, j])
            if stochastic and math.isfinite(value) and (half & np.uint32(0x7FFF)) < np.uint32(0x7C00):
                nearest = _half_value(half)
                if nearest != value:
                    magnitude = half & np.uint32(0x7FFF)
                    sign = np.uint32(0x8000) if value < 0 else np.uint32(0)
                    if abs(value) > abs(nearest):
                        other = sign | (magnitude + np.uint32(1))
                    else:
                        other = sign | (magnitude - np.uint32(1))
                    if (other & np.uint32(0x7FFF)) < np.uint32(0x7C00):
                        other_value = _half_value(other)
                        if _rounding_uniform(base, j) < (value - nearest) / (other_value - nearest):
                            half = other
            target[j] = np.uint16(half)


@numba.njit(cache=True, nogil=True)
def _fp16_decode_kernel(storage, rows, out_bits):  # pragma: no cover - numba
    count = rows.shape[0]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            prefetch_row(storage, rows[i + PREFETCH_DISTANCE])
        source = storage[rows[i]]
        for j in range(source.shape[0]):
            out_bits[i, j] = _float_bits_of_half(np.uint32(source[j]))


@numba.njit(cache=True, nogil=True)
def _int8_encode_kernel(
    values, codes, scales, offsets, rows, stochastic, ids, seed, step
):  # pragma: no cover
    dim = values.shape[1]
    for i in range(values.shape[0]):
        row = rows[i]
        low = values[i, 0]
        high = values[i, 0]
        for j in range(1, dim):
            low = min(low, values[i, j])
            high = max(high, values[i, j])
        scale = np.float32((high - low) / np.float32(INT8_LEVELS))
        offsets[row] = low
        scales[row] = scale
        target = codes[row]
        if scale == 0:
            for j in range(dim):
                target[j] = 0
            continue
        base = _rounding_base(ids[i], seed, step) if stochastic else np.uint64(0)
        for j in range(dim):
            level = (values[i, j] - low) / scale
            shift = _rounding_uniform(base, j) if stochastic else 0.5
            code = math.floor(level + shift)
            target[j] = np.uint8(min(max(code, 0.0), INT8_LEVELS))


@numba.njit(cache=True, nogil=True)
def _int8_decode_kernel(codes, scales, offsets, rows, out):  # pragma: no cover - numba
    count = rows.shape[0]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            ahead = rows[i + PREFETCH_DISTANCE]
            prefetch_row(codes, ahead)
            prefetch(scales, ahead)
            prefetch(offsets, ahead)
        row = rows[i]
        scale = scales[row]
        offset = offsets[row]
        source = codes[row]
        for j in range(source.shape[0]):
            out[i, j] = np.float32(source[j]) * scale + offset


@numba.njit(cache=True, nogil=True)
def _fp32_gather_kernel(storage, rows, out):  # pragma: no cover - numba
    count = rows.shape[0]
    for i in range(count):
        if i + PREFETCH_DISTANCE < count:
            prefetch_row(storage, rows[i + PREFETCH_DISTANCE])
        source = storage[rows[i]]
        for j in range(source.shape[0]):
            out[i, j] = source[j]


class RowStorage:
    """Row payload arrays for one precision, indexed by row number."""

    def __init__(self, precision: str, dim: int, *, stochastic_rounding: bool, seed: int) -> None:
        self.precision = precision
        self.dim = dim
        self.stochastic_rounding = stochastic_rounding and precision != "fp32"
        self.rounding_seed = np.uint64((seed * GOLDEN_GAMMA + ROUNDING_DOMAIN) % (1 << 64))
        dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.uint8}[precision]
        self.values = np.zeros((0, dim), dtype=dtype)
        self.scales = np.zeros(0, dtype=np.float32) if precision == "int8" else None
        self.offsets = np.zeros(0, dtype=np.float32) if precision == "int8" else None

    def nbytes(self) -> int:
        total = self.values.nbytes
        if self.scales is not None and self.offsets is not None:
            total += self.scales.nbytes + self.offsets.nbytes
        return int(total)

    def grow(self, row_capacity: int) -> None:
        if self.values.shape[0] >= row_capacity:
            return
        self.values = grow_rows(self.values, row_capacity)
        if self.scales is not None and self.offsets is not None:
            self.scales = grow_rows(self.scales, row_capacity)
            self.offsets = grow_rows(self.offsets, row_capacity)

    def gather(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """(len(rows), dim) float32 values of the given rows (all >= 0), written into `out` (C-contiguous
        float32 of that shape) when given."""
        if out is None:
            out = np.empty((rows.shape[0], self.dim), dtype=np.float32)
        if self.precision == "fp32":
            _fp32_gather_kernel(self.values, rows, out)
        elif self.precision == "fp16":
            _fp16_decode_kernel(self.values.view(np.uint16), rows, out.view(np.uint32))
        else:
            _int8_decode_kernel(self.values, self.scales, self.offsets, rows, out)
        return out

    def write(
        self, rows: np.ndarray, values: np.ndarray, ids: np.ndarray, step: int, *, stochastic: bool
    ) -> None:
        """Store float32 ``values`` (k, dim) into ``rows``; ``ids``/``step`` seed stochastic rounding."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        use_stochastic = stochastic and self.stochastic_rounding
        if self.precision == "fp32":
            self.values[rows] = values
        elif self.precision == "fp16":
            _fp16_encode_kernel(
                values,
                values.view(np.uint32),
                self.values.view(np.uint16),
                rows,
                use_stochastic,
                ids,
                self.rounding_seed,
                np.uint64(step),
            )
        else:
            _int8_encode_kernel(
                values,
                self.values,
                self.scales,
                self.offsets,
                rows,
                use_stochastic,
                ids,
                self.rounding_seed,
                step,
            )

    def round_trip(self, values: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """``values`` as they read back after a round-to-nearest store (used for unstored rows)."""
        if self.precision == "fp32":
            return values
        scratch = RowStorage(self.precision, self.dim, stochastic_rounding=False, seed=0)
        scratch.grow(values.shape[0])
        rows = np.arange(values.shape[0], dtype=np.int32)
        scratch.write(rows, values, ids, 0, stochastic=False)
        return scratch.gather(rows)

    def export(self, rows: np.ndarray) -> dict[str, np.ndarray | None]:
        return {
            "rows": self.values[rows],
            "row_scale": None if self.scales is None else self.scales[rows],
            "row_offset": None if self.offsets is None else self.offsets[rows],
        }

    def assign(
        self,
        rows: np.ndarray | slice,
        payload: np.ndarray,
        scales: np.ndarray | None,
        offsets: np.ndarray | None,
    ) -> None:
        """Store already-encoded rows (from an exported state or delta)."""
        self.values[rows] = payload
        if self.scales is not None and self.offsets is not None:
            self.scales[rows] = scales
            self.offsets[rows] = offsets
