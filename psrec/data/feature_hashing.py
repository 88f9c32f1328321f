"""Feature hashing: (namespace, raw value) -> int64 id, vectorised, with no vocabulary pass.

Layout of a hashed id (63 bits, always non-negative)::

    bit 63      0
    bits 48-62  namespace tag, 1 + blake2b(namespace) mod 32767 (never 0)
    bits 0-47   value hash: FNV-1a over the value's bytes, seeded per namespace, then murmur3's fmix64

"Never collide by construction" means: ids of two namespaces with different tags differ in their top
bits, so no value of one feature can land on an id of another, whatever the values are. Tags are 15
bits, so two namespaces can share a tag; `Schema` checks that namespaces sharing an embedding table
have different tags and asks to rename one otherwise (tables never share ids with other tables, so
a tag clash across tables is harmless). Pass-through ids (`hashed=False`) must lie in [0, 2**48)
and so have tag 0, which no namespace gets: they never collide with hashed ids either. Within one
namespace, distinct values collide with probability ~ n**2 / 2**49 (one pair among ~10M values).

Integers hash as their decimal text (`7` and `"7"` give the same id), and a missing value (null)
hashes as the empty string, so a column gives the same ids whether it was stored as text or
integers, in TSV or Parquet. Everything is deterministic across processes, runs and machines
(never Python's `hash()`): `hash_reference` is the plain-Python oracle the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from psrec.data.namespaces import namespace_seed, namespace_tag

VALUE_BITS = 48
VALUE_MASK = (1 << VALUE_BITS) - 1
MAX_PASSTHROUGH_ID = 1 << VALUE_BITS  # exclusive

_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


@numba.njit(cache=True, nogil=True, inline="always")
def _fmix64(h: np.uint64) -> np.uint64:
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


@numba.njit(cache=True, nogil=True)
def _hash_strings(data: np.ndarray, offsets: np.ndarray, valid: np.ndarray, seed: np.uint64) -> np.ndarray:
    n = offsets.size - 1
    out = np.empty(n, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    for i in range(n):
        h = seed
        if valid[i]:
            for j in range(offsets[i], offsets[i + 1]):
                h = (h ^ np.uint64(data[j])) * prime
        out[i] = _fmix64(h)
    return out


@numba.njit(cache=True, nogil=True)
def _hash_integers(values: np.ndarray, valid: np.ndarray, seed: np.uint64) -> np.ndarray:
    n = values.size
    out = np.empty(n, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    digits = np.empty(20, dtype=np.uint8)
    for i in range(n):
        h = seed
        if valid[i]:
            value = values[i]
            negative = value < 0
            # magnitude as uint64 (handles the most negative int64)
            magnitude = np.uint64(-(value + 1)) + np.uint64(1) if negative else np.uint64(value)
            count = 0
            while True:
                digits[count] = np.uint8(48 + magnitude % np.uint64(10))
                magnitude //= np.uint64(10)
                count += 1
                if magnitude == 0:
                    break
            if negative:
                h = (h ^ np.uint64(45)) * prime  # "-"
            for k in range(count - 1, -1, -1):
                h = (h ^ np.uint64(digits[k])) * prime
        out[i] = _fmix64(h)
    return out


def _finish(raw: np.ndarray, namespace: str) -> np.ndarray:
    tag_bits = np.uint64(namespace_tag(namespace) << VALUE_BITS)
    return ((raw & np.uint64(VALUE_MASK)) | tag_bits).view(np.int64)


def _valid_mask(array: pa.Array) -> np.ndarray:
    if array.null_count == 0:
        return np.ones(len(array), dtype=np.bool_)
    return pc.is_valid(array).to_numpy(zero_copy_only=False)


def _hash_arrow(namespace: str, array: pa.Array) -> np.ndarray:
    seed = np.uint64(namespace_seed(namespace))
    kind = array.type
    if pa.types.is_dictionary(kind):
        dictionary_ids = _hash_arrow(namespace, array.dictionary)
        indices = array.indices if array.null_count == 0 else array.indices.fill_null(0)
        indices = indices.to_numpy(zero_copy_only=False)
        out = np.take(dictionary_ids, indices)  # 15% faster than dictionary_ids[indices] here
        if array.null_count:
            out[~_valid_mask(array)] = _hash_arrow(namespace, pa.array([None], pa.string()))[0]
        return out
    if pa.types.is_integer(kind):
        values = array.fill_null(0).cast(pa.int64(), safe=False) if kind != pa.int64() else array.fill_null(0)
        if pa.types.is_uint64(kind) and len(array) and pc.max(array).as_py() >= 1 << 63:
            return _hash_arrow(namespace, array.cast(pa.string()))
        return _finish(_hash_integers(values.to_numpy(), _valid_mask(array), seed), namespace)
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        offset_type: type = np.int32
    elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        offset_type = np.int64
    else:
        raise TypeError(f"cannot hash values of Arrow type {kind}; expected text or integers")
    buffers = array.buffers()
    offsets: np.ndarray = np.frombuffer(buffers[1], dtype=offset_type)[
        array.offset : array.offset + len(array) + 1
    ]
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    return _finish(_hash_strings(data, offsets, _valid_mask(array), seed), namespace)


def hash_values(namespace: str, values: Any) -> np.ndarray:
    """Hash `values` (a sequence, NumPy array or Arrow array of text or integers) into int64 ids.

    >>> hash_values("C1", ["05db9164", "", None]).dtype
    dtype('int64')
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return _hash_arrow(namespace, values)
    array = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if array.dtype.kind in "iu" and array.ndim == 1:
        return _hash_arrow(namespace, pa.array(array))
    if array.dtype.kind == "b":
        return _hash_arrow(namespace, pa.array(array.astype(np.int64)))
    return _hash_arrow(namespace, pa.array(list(values) if array.dtype == object else array.tolist()))


def hash_reference(namespace: str, values: Sequence[str | int | None]) -> list[int]:
    """Plain-Python oracle of `hash_values` (slow; for tests and documentation)."""
    seed = namespace_seed(namespace)
    tag = namespace_tag(namespace)
    out = []
    for value in values:
        text = b"" if value is None else str(value).encode("utf-8")
        h = seed
        for byte in text:
            h = ((h ^ byte) * _FNV_PRIME) & _MASK64
        for shift, multiplier in ((33, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53)):
            h ^= h >> shift
            h = (h * multiplier) & _MASK64
        h ^= h >> 33
        out.append((tag << VALUE_BITS) | (h & VALUE_MASK))
    return out
