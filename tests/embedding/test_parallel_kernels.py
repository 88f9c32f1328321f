"""The parallel batch kernels of the tables give bit-identical results to their one-thread kernels
(the oracle: the same per-row math run serially), and the dispatch picks them only for large batches."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from psrec.embedding import optimizers
from psrec.embedding.optimizers import aggregate_gradients, all_finite
from psrec.embedding.specs import SparseOptimizerSpec
from psrec.embedding.table import EmbeddingTable

ROWS, DIM = 6000, 32  # 192k values per full batch: above PARALLEL_MIN_VALUES


@pytest.fixture
def two_threads():
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    yield numba.get_num_threads()
    numba.set_num_threads(before)


def _arguments(rng: np.random.Generator, per_element: bool):
    weights = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    rows = rng.permutation(ROWS)[: ROWS - 7].astype(np.int32)  # unique, random order, odd count
    grads = rng.standard_normal((rows.shape[0], DIM)).astype(np.float32)
    grad_rows = rng.permutation(rows.shape[0]).astype(np.int32)
    metadata = rng.integers(0, 5, size=(ROWS, 2)).astype(np.uint32)
    occurrences = rng.integers(1, 4, size=rows.shape[0]).astype(np.int32)
    shape = (ROWS, DIM) if per_element else (ROWS,)
    accumulator = rng.random(shape).astype(np.float32)
    return weights, rows, grads, grad_rows, metadata, occurrences, accumulator


@pytest.mark.parametrize(
    ("serial", "parallel", "per_element"),
    [
        ("_adagrad_kernel", "_adagrad_parallel", True),
        ("_rowwise_adagrad_kernel", "_rowwise_adagrad_parallel", False),
    ],
)
def test_parallel_update_equals_serial_bitwise(two_threads, serial, parallel, per_element):
    rng = np.random.default_rng(7)
    args = _arguments(rng, per_element)
    results = []
    for kernel in (getattr(optimizers, serial), getattr(optimizers, parallel)):
        weights, rows, grads, grad_rows, metadata, occurrences, accumulator = (a.copy() for a in args)
        kernel(
            weights, rows, rows, grads, grad_rows, metadata, occurrences, np.uint32(9), accumulator,
            np.float32(0.05), np.float32(1e-8), np.float32(0.01),
        )  # fmt: skip
        results.append((weights, metadata, accumulator))
    for left, right in zip(*results, strict=True):
        assert np.array_equal(left, right)
    # rows outside the batch are untouched
    untouched = np.setdiff1d(np.arange(ROWS), args[1])
    assert np.array_equal(results[1][0][untouched], args[0][untouched])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 150_000, -1])
def test_all_finite_finds_one_bad_value_anywhere(two_threads, bad, where):
    values = np.ones((5000, DIM), np.float32)
    assert all_finite(values)
    values.reshape(-1)[where] = bad
    assert not all_finite(values)
    assert all_finite(values[-10:]) == (where != -1)  # the one-thread path of a small array
    small = np.ones((3, DIM), np.float32)
    small[1, 2] = bad
    assert not all_finite(small)


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad"])
def test_table_push_matches_one_thread(name):
    """A large push on two threads leaves the table exactly as the same push on one thread."""
    rng = np.random.default_rng(11)
    ids = rng.choice(10**9, size=ROWS, replace=False).astype(np.int64)
    grads = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    tables = []
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            table = EmbeddingTable("t", DIM, optimizer=SparseOptimizerSpec(name=name, lr=0.05), seed=5)
            table.pull(ids)
            table.push(ids, grads, step=1)
            tables.append(table.pull(ids, train=False))
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(tables[0], tables[1])


def test_aggregate_rejects_nan_in_a_large_batch(two_threads):
    grads = np.zeros((ROWS, DIM), np.float32)
    grads[ROWS - 1, DIM - 1] = np.nan
    *_, finite = aggregate_gradients(np.arange(ROWS, dtype=np.int32), grads)
    assert not finite
