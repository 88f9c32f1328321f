"""Deterministic initial rows and hashing: numba kernels against their NumPy twins."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from psrec.embedding import InitializerSpec
from psrec.embedding.hashing import fastrange32, fastrange32_numpy, hash_key, hash_key_numpy
from psrec.embedding.initializers import initial_rows, initial_rows_numpy, write_initial_rows

IDS = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0, 1, 42, -(2**40)], dtype=np.int64)


@numba.njit(cache=True)
def _hash_and_reduce(ids, seed, capacity):  # pragma: no cover - numba
    hashes = np.empty(ids.shape[0], dtype=np.uint64)
    positions = np.empty(ids.shape[0], dtype=np.int64)
    for i in range(ids.shape[0]):
        hashes[i] = hash_key(ids[i], seed)
        positions[i] = fastrange32(hashes[i], capacity)
    return hashes, positions


def test_hash_and_fastrange_match_numpy() -> None:
    ids = np.concatenate([IDS, np.random.default_rng(0).integers(-(2**62), 2**62, size=1000)])
    hashes, positions = _hash_and_reduce(ids, np.uint64(12345), 1_000_003)
    np.testing.assert_array_equal(hashes, hash_key_numpy(ids, 12345))
    np.testing.assert_array_equal(positions, fastrange32_numpy(hashes, 1_000_003))
    assert positions.min() >= 0 and positions.max() < 1_000_003


@pytest.mark.parametrize(
    "spec",
    [InitializerSpec("normal", std=0.1), InitializerSpec("uniform", scale=0.5), InitializerSpec("zeros")],
)
@pytest.mark.parametrize("dim", [1, 7, 16])
def test_kernel_matches_numpy_oracle(spec, dim) -> None:
    np.testing.assert_allclose(
        initial_rows(IDS, dim, spec, 7), initial_rows_numpy(IDS, dim, spec, 7), rtol=1e-5, atol=1e-6
    )


def test_rows_depend_only_on_seed_and_id() -> None:
    spec = InitializerSpec()
    rows = initial_rows(IDS, 8, spec, 3)
    np.testing.assert_array_equal(initial_rows(IDS[::-1].copy(), 8, spec, 3)[::-1], rows)
    np.testing.assert_array_equal(initial_rows(IDS[2:3], 8, spec, 3), rows[2:3])
    assert not np.array_equal(initial_rows(IDS, 8, spec, 4), rows)


def test_distributions_have_the_requested_scale() -> None:
    ids = np.arange(20_000, dtype=np.int64)
    normal = initial_rows(ids, 16, InitializerSpec("normal", std=0.02), 0)
    assert abs(normal.mean()) < 3e-4 and abs(normal.std() - 0.02) < 5e-4
    uniform = initial_rows(ids, 16, InitializerSpec("uniform", scale=0.05), 0)
    assert uniform.min() >= -0.05 and uniform.max() < 0.05 and abs(uniform.std() - 0.05 / np.sqrt(3)) < 5e-4


@pytest.mark.parametrize("kind", ["zeros", "uniform", "normal"])
def test_write_initial_rows_writes_the_rows_in_place(kind: str) -> None:
    spec = InitializerSpec(kind, std=0.5, scale=0.3)
    out = np.full((10, 6), 7.0, np.float32)
    rows = np.array([8, 2, 5], dtype=np.int32)
    write_initial_rows(out, rows, IDS[:3], spec, 11)
    np.testing.assert_array_equal(out[rows], initial_rows(IDS[:3], 6, spec, 11))
    untouched = np.setdiff1d(np.arange(10), rows)
    np.testing.assert_array_equal(out[untouched], np.full((7, 6), 7.0, np.float32))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        write_initial_rows(out, np.array([10]), IDS[:1], spec, 11)
    with pytest.raises(ValueError, match="float32"):
        write_initial_rows(out.astype(np.float64), rows, IDS[:3], spec, 11)
