"""Compact wire format: fp16 rows, fp16 gradients with a per-row scale."""

from __future__ import annotations

import numpy as np
import pytest

from psrec.ps.wire import ScaledFp16, decode_gradients, decode_rows, encode_gradients, encode_rows


def test_fp32_is_passed_through_untouched() -> None:
    rows = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    assert encode_rows(rows, "fp32") is rows and decode_rows(rows) is rows
    assert encode_gradients(rows, "fp32") is rows and decode_gradients(rows) is rows


def test_fp16_rows_halve_the_bytes_within_fp16_precision() -> None:
    rows = np.random.default_rng(1).normal(scale=0.05, size=(100, 64)).astype(np.float32)
    rows[0, 0] = 1e6  # beyond float16: clipped, not inf
    wire = encode_rows(rows, "fp16")
    assert wire.dtype == np.float16 and wire.nbytes == rows.nbytes // 2
    back = decode_rows(wire)
    assert back.dtype == np.float32 and np.isfinite(back).all()
    np.testing.assert_allclose(back[1:], rows[1:], rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("magnitude", [1e-9, 1e-4, 1.0, 1e4])
def test_scaled_fp16_gradients_keep_11_bits_at_any_magnitude(magnitude: float) -> None:
    grads = (np.random.default_rng(2).normal(size=(50, 16)) * magnitude).astype(np.float32)
    grads[3] = 0.0  # an all-zero row stays zero
    wire = encode_gradients(grads, "fp16")
    assert isinstance(wire, ScaledFp16) and wire.nbytes == 50 * 16 * 2 + 50 * 4
    back = decode_gradients(wire)
    assert back.dtype == np.float32 and not back[3].any()
    peak = np.abs(grads).max(axis=1, keepdims=True)
    assert (np.abs(back - grads) <= peak * 2.0**-11 + 1e-45).all()
    # a plain float16 cast would have lost the tiny ones entirely
    if magnitude == 1e-9:
        assert not grads.astype(np.float16).any()
