"""64-bit mixing functions shared by the hash index, the initializer, admission and rounding.

``mix64`` is the SplitMix64 finalizer (Steele et al.): a bijection on 64-bit words with good
avalanche, so hashing an int64 id never collides before reduction. ``mix64``, ``hash_key`` and
``fastrange32`` have NumPy twins (suffix ``_numpy``) computing the same bits on arrays; tests compare
them.

``fastrange32`` maps the top 32 bits of a hash onto ``[0, capacity)`` with a multiply-shift
(Lemire's fastrange) instead of a power-of-two mask, so tables can grow by any factor.
"""

from __future__ import annotations

import numba
import numpy as np

MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9
MIX_MULTIPLIER_2 = 0x94D049BB133111EB
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
UNIT_SCALE = 1.0 / float(1 << 53)


@numba.njit(cache=True, nogil=True, inline="always")
def mix64(value):  # pragma: no cover - numba
    value = np.uint64(value)
    value ^= value >> np.uint64(30)
    value *= np.uint64(MIX_MULTIPLIER_1)
    value ^= value >> np.uint64(27)
    value *= np.uint64(MIX_MULTIPLIER_2)
    value ^= value >> np.uint64(31)
    return value


@numba.njit(cache=True, nogil=True, inline="always")
def hash_key(key, seed):  # pragma: no cover - numba
    """Hash of an int64 key under a 64-bit seed."""
    return mix64(np.uint64(key) ^ mix64(np.uint64(seed) + np.uint64(GOLDEN_GAMMA)))


@numba.njit(cache=True, nogil=True, inline="always")
def fastrange32(hash_value, capacity):  # pragma: no cover - numba
    """Top 32 bits of ``hash_value`` scaled onto ``[0, capacity)``; capacity < 2**32."""
    return np.int64(((hash_value >> np.uint64(32)) * np.uint64(capacity)) >> np.uint64(32))


@numba.njit(cache=True, nogil=True, inline="always")
def unit_float(hash_value):  # pragma: no cover - numba
    """A float in [0, 1) from the top 53 bits of a hash."""
    return float(hash_value >> np.uint64(11)) * UNIT_SCALE


def mix64_numpy(values: np.ndarray) -> np.ndarray:
    """NumPy twin of ``mix64`` on a uint64 array (wrapping arithmetic)."""
    values = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        values ^= values >> np.uint64(30)
        values *= np.uint64(MIX_MULTIPLIER_1)
        values ^= values >> np.uint64(27)
        values *= np.uint64(MIX_MULTIPLIER_2)
        values ^= values >> np.uint64(31)
    return values


def hash_key_numpy(keys: np.ndarray, seed: int) -> np.ndarray:
    """NumPy twin of ``hash_key`` on an int64 array."""
    with np.errstate(over="ignore"):
        seed_word = np.array([(seed + GOLDEN_GAMMA) % (1 << 64)], dtype=np.uint64)
    return mix64_numpy(keys.astype(np.int64).view(np.uint64) ^ mix64_numpy(seed_word)[0])


def fastrange32_numpy(hash_values: np.ndarray, capacity: int) -> np.ndarray:
    """NumPy twin of ``fastrange32``."""
    with np.errstate(over="ignore"):
        return ((hash_values >> np.uint64(32)) * np.uint64(capacity) >> np.uint64(32)).astype(np.int64)
