import numpy as np
import pytest

from psrec.ps.routing import bucket_of, default_bucket_map, route


def test_buckets_are_stable_and_spread() -> None:
    ids = np.arange(100_000, dtype=np.int64)
    buckets = bucket_of(ids, 64)
    assert buckets.min() >= 0 and buckets.max() < 64
    counts = np.bincount(buckets, minlength=64)
    assert counts.min() > 0.8 * counts.mean()  # sequential ids spread evenly
    # Pinned values: the routing of an id must never change between versions (checkpoints rely on it).
    extremes = np.array([0, 1, -1, 2**63 - 1, -(2**63)], dtype=np.int64)
    assert bucket_of(extremes, 1024).tolist() == [0, 485, 379, 701, 394]


def test_default_bucket_map_blocks() -> None:
    assert default_bucket_map(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert set(default_bucket_map(1024, 3).tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="at least as many virtual buckets"):
        default_bucket_map(4, 8)


def test_route_split_gather_round_trip() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**63), 2**63 - 1, size=1000, dtype=np.int64)
    bucket_map = default_bucket_map(16, 3)
    routed = route(ids, bucket_map)
    assert sum(p.size for p in routed.ids_per_shard) == ids.size
    for shard, part in enumerate(routed.ids_per_shard):
        assert (bucket_map[bucket_of(part, 16)] == shard).all()
    values = ids.astype(np.float64)[:, None] * np.array([1.0, 2.0])
    parts = routed.split(values)
    for part_ids, part_values in zip(routed.ids_per_shard, parts, strict=True):
        np.testing.assert_array_equal(part_ids.astype(np.float64), part_values[:, 0])
    np.testing.assert_array_equal(routed.gather(parts), values)
