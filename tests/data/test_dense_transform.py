"""Dense transforms (`features._dense_column`) against a float64 reference, and what they count."""

import numpy as np
import pyarrow as pa
import pytest

from psrec.data.features import FLOAT32_MAX, DenseCounts, _dense_column
from psrec.data.schema import DenseFeature


def _reference(feature: DenseFeature, values: list[float | None]) -> np.ndarray:
    """fill missing / NaN / infinite, clamp to float32's range, clip, log1p(max(x, 0)), in float64."""
    out = np.array([feature.fill if v is None or not np.isfinite(v) else v for v in values], np.float64)
    out = np.clip(out, -FLOAT32_MAX, FLOAT32_MAX)
    if feature.clip is not None:
        out = np.clip(out, *feature.clip)
    if feature.log1p:
        out = np.log1p(np.maximum(out, 0.0))
    return out


@pytest.mark.parametrize(
    "column",
    [
        pa.chunked_array([pa.array([3, -2, 0, 70000, 5], pa.int64()), pa.array([1 << 40], pa.int64())]),
        pa.chunked_array([pa.array([3, None, 0, 70000, 5, 1 << 40], pa.int64())]),  # nulls: the float path
        pa.chunked_array([pa.array([3, 7, 0, 200, 5, 9], pa.int32())]),
        pa.chunked_array([pa.array([3.5, float("nan"), float("inf"), None, -1.0, 1e300], pa.float64())]),
        pa.chunked_array([pa.array([-1e39, 3.4028235e38, -float("inf"), 2.0], pa.float64())]),
    ],
)
@pytest.mark.parametrize(
    "feature",
    [
        DenseFeature(name="x"),
        DenseFeature(name="x", fill=2.0, log1p=False),
        DenseFeature(name="x", fill=1.0, clip=(-1, 100)),
        DenseFeature(name="x", log1p=True),
    ],
)
def test_dense_column_fills_clips_and_log1p_like_float64(
    feature: DenseFeature, column: pa.ChunkedArray
) -> None:
    """Integer columns without nulls take a direct float32 path; every path agrees with float64
    to float32 precision, and no value comes out non-finite."""
    values = column.to_pylist()
    got, _ = _dense_column(feature, column)
    assert got.dtype == np.float32 and got.shape == (len(values),)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(feature, values).astype(np.float32), rtol=2e-7, atol=0)


def test_dense_column_counts_missing_filled_and_clipped_values() -> None:
    column = pa.chunked_array(
        [pa.array([1.0, None, float("nan"), float("inf"), 1e300, -1e40, 3.4e38, None], pa.float64())]
    )
    values, counts = _dense_column(DenseFeature(name="x", fill=-1.0), column)
    assert counts == DenseCounts(missing=2, filled=2, clipped=2)
    assert values.tolist()[:4] == [1.0, -1.0, -1.0, -1.0]
    assert values[4] == np.finfo(np.float32).max and values[5] == -np.finfo(np.float32).max
    assert _dense_column(DenseFeature(name="x"), pa.chunked_array([pa.array([1.0, 2.0])]))[1] == DenseCounts()
