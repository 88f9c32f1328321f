"""Row storage precisions against NumPy casts and the reference int8 formula; stochastic rounding."""

from __future__ import annotations

import numpy as np
import pytest

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.embedding.precision import RowStorage
from psrec.testing.embedding_reference import int8_round_trip_numpy


def _special_float32_values() -> np.ndarray:
    finfo16 = np.finfo(np.float16)
    edges = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        float(finfo16.max),
        65519.99,
        65520.0,
        65536.0,
        1e30,
        float(finfo16.tiny),
        float(finfo16.smallest_subnormal),
        float(finfo16.smallest_subnormal) / 2,
        float(finfo16.smallest_subnormal) * 0.51,
        float(finfo16.smallest_subnormal) * 1.5,
        float(finfo16.smallest_subnormal) * 2.5,
        1.0 + 2.0**-11,  # tie: rounds to even
        1.0 + 3 * 2.0**-11,
        np.inf,
        -np.inf,
    ]
    generator = np.random.default_rng(0)
    random_bits = (
        generator.integers(0, 2**32, size=20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    random_values = generator.normal(scale=10.0 ** generator.uniform(-9, 5, size=20_000)).astype(np.float32)
    values = np.concatenate([np.array(edges, dtype=np.float32), random_bits, random_values])
    return np.concatenate([values, -values])


def _store(precision: str, values: np.ndarray, *, stochastic: bool = False, step: int = 0) -> np.ndarray:
    storage = RowStorage(precision, values.shape[1], stochastic_rounding=stochastic, seed=3)
    storage.grow(values.shape[0])
    rows = np.arange(values.shape[0], dtype=np.int32)
    storage.write(rows, values, np.arange(values.shape[0], dtype=np.int64), step, stochastic=stochastic)
    return storage.gather(rows)


def test_fp16_round_to_nearest_matches_numpy_cast_bit_for_bit() -> None:
    values = _special_float32_values()
    values = values[~np.isnan(values)].reshape(-1, 2)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(_store("fp16", values).view(np.uint32), expected.view(np.uint32))


def test_fp16_stochastic_rounding_is_unbiased_and_picks_a_neighbour() -> None:
    value = np.float32(1.0 + 2.0**-12)  # a quarter of the way from 1 to the next half
    values = np.full((4000, 8), value, dtype=np.float32)
    stored = _store("fp16", values, stochastic=True, step=1)
    assert set(np.unique(stored).tolist()) == {1.0, 1.0 + 2.0**-10}
    assert abs(float(stored.mean()) - float(value)) < 2e-5
    np.testing.assert_array_equal(stored, _store("fp16", values, stochastic=True, step=1))  # reproducible


def test_int8_matches_reference_and_error_is_within_half_a_step() -> None:
    generator = np.random.default_rng(1)
    values = generator.normal(size=(500, 16)).astype(np.float32)
    values[0] = 3.0  # constant row: exact
    stored = _store("int8", values)
    np.testing.assert_allclose(stored, int8_round_trip_numpy(values), rtol=0, atol=1e-6)
    steps = (values.max(axis=1) - values.min(axis=1)) / 255.0
    assert np.all(np.abs(stored - values) <= steps[:, None] * 0.5 + 1e-6)
    np.testing.assert_array_equal(stored[0], values[0])


def test_int8_stochastic_rounding_is_unbiased() -> None:
    row = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    values = np.tile(row, (3000, 1))
    values[:, 3] += 0.3 * (2.0 / 255.0)
    stored = _store("int8", values, stochastic=True, step=2)
    assert abs(float(stored[:, 3].mean()) - float(values[0, 3])) < 3e-4


@pytest.mark.parametrize(("precision", "payload_ratio"), [("fp16", 0.5), ("int8", (64 + 8) / 256)])
def test_low_precision_payload_bytes(precision, payload_ratio) -> None:
    ids = np.arange(1000, dtype=np.int64)
    reference = EmbeddingTable("p", 64, optimizer=SparseOptimizerSpec("sgd"))
    table = EmbeddingTable("p", 64, optimizer=SparseOptimizerSpec("sgd"), precision=precision)
    reference.pull(ids)
    table.pull(ids)
    assert table.memory_bytes()["payload"] == pytest.approx(
        reference.memory_bytes()["payload"] * payload_ratio
    )


@pytest.mark.parametrize("precision", ["fp16", "int8"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_low_precision_training_tracks_fp32(precision, stochastic) -> None:
    spec = SparseOptimizerSpec("rowwise_adagrad", lr=0.05)
    ids = np.arange(64, dtype=np.int64)
    tables = [
        EmbeddingTable("p", 16, optimizer=spec),
        EmbeddingTable("p", 16, optimizer=spec, precision=precision, stochastic_rounding=stochastic),
    ]
    generator = np.random.default_rng(2)
    for step in range(1, 21):
        grads = generator.normal(size=(64, 16)).astype(np.float32)
        for table in tables:
            table.pull(ids)
            table.push(ids, grads, step=step)
    full, low = (table.pull(ids, train=False) for table in tables)
    tolerance = 2e-3 if precision == "fp16" else 2e-2
    assert np.abs(full - low).mean() < tolerance
