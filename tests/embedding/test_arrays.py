"""grow_rows: in-place growth keeps contents and zero-fills; views fall back to a copy."""

from __future__ import annotations

import numpy as np

from psrec.embedding.arrays import grow_rows


def test_grows_in_place_and_zero_fills() -> None:
    array = np.arange(12, dtype=np.float32).reshape(6, 2).copy()
    grown = grow_rows(array, 10)
    assert grown is array and grown.shape == (10, 2)
    np.testing.assert_array_equal(grown[:6], np.arange(12).reshape(6, 2))
    assert not grown[6:].any()
    assert grow_rows(grown, 4) is grown


def test_views_are_copied_not_resized() -> None:
    base = np.arange(20, dtype=np.int64)
    view = base[:10]
    grown = grow_rows(view, 15)
    assert grown is not view and grown.shape == (15,)
    np.testing.assert_array_equal(grown[:10], np.arange(10))
    np.testing.assert_array_equal(base, np.arange(20))
