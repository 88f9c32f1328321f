import numpy as np
import pyarrow as pa
import pytest

from psrec.data.features import _dense_column
from psrec.data.schema import DenseFeature


def _reference(feature: DenseFeature, values: list[float | None]) -> np.ndarray:
    """fill missing / non-finite, clip, log1p(max(x, 0)), in float64."""
    out = np.array([feature.fill if v is None or not np.isfinite(v) else v for v in values], np.float64)
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
    ],
)
@pytest.mark.parametrize(
    "feature",
    [
        DenseFeature(name="x"),
        DenseFeature(name="x", fill=2.0, log1p=False),
        DenseFeature(name="x", fill=1.0, clip=(-1, 100)),
    ],
)
def test_dense_column_fills_clips_and_log1p_like_float64(
    feature: DenseFeature, column: pa.ChunkedArray
) -> None:
    """Integer columns without nulls take a direct float32 path; every path agrees with float64
    to float32 precision (finite values beyond float32's range become infinities before clip)."""
    values = column.to_pylist()
    got = _dense_column(feature, column)
    assert got.dtype == np.float32 and got.shape == (len(values),)
    with np.errstate(over="ignore"):
        expected = _reference(feature, values).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0)
