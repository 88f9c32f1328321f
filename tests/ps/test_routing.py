import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.ps.routing import Routed, bucket_of, dedup_and_route, default_bucket_map, route


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


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    num_shards=st.integers(1, 4),
    spread=st.sampled_from([3, 50, 2**62]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dedup_and_route_matches_unique_and_route(
    sizes: list[int], num_shards: int, spread: int, seed: int
) -> None:
    """One pass over several tables = np.unique per table + `route`, shard-grouped, first occurrence first."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(-spread, spread, size=n, dtype=np.int64) for n in sizes]
    ids = np.concatenate(parts)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    bucket_map = default_bucket_map(16, num_shards)
    unique, inverse, unique_starts, counts = dedup_and_route(ids, starts, bucket_map)
    np.testing.assert_array_equal(unique[inverse], ids)
    for t, part in enumerate(parts):
        mine = unique[unique_starts[t] : unique_starts[t + 1]]
        assert np.all(inverse[starts[t] : starts[t + 1]] >= unique_starts[t])
        assert np.all(inverse[starts[t] : starts[t + 1]] < unique_starts[t + 1])
        expected = route(np.unique(part), bucket_map)
        bounds = np.concatenate([[0], np.cumsum(counts[t])])
        for shard in range(num_shards):
            group = mine[bounds[shard] : bounds[shard + 1]]
            want = expected.ids_per_shard[shard] if shard < len(expected.ids_per_shard) else part[:0]
            np.testing.assert_array_equal(np.sort(group), want)
            # first-occurrence order within the shard's group
            first_seen = [int(np.flatnonzero(part == value)[0]) for value in group]
            assert first_seen == sorted(first_seen)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 40),
    tables=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_dedup_and_route_writes_the_sample_major_index(batch: int, tables: list[int], seed: int) -> None:
    """`sample_major`: the same dedup, with the inverse transposed to (batch, features) columns."""
    rng = np.random.default_rng(seed)
    features = sum(tables)
    ids = rng.integers(0, 30, size=batch * features, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(tables)]).astype(np.int64) * batch
    columns = rng.permutation(features)  # block k of the ids is feature columns[k]
    bucket_map = default_bucket_map(16, 3)
    plain = dedup_and_route(ids, starts, bucket_map)
    unique, inverse, unique_starts, counts = dedup_and_route(
        ids, starts, bucket_map, sample_major=(batch, columns)
    )
    np.testing.assert_array_equal(unique, plain[0])
    np.testing.assert_array_equal(unique_starts, plain[2])
    np.testing.assert_array_equal(counts, plain[3])
    grid = inverse.reshape(batch, features)
    for k, column in enumerate(columns):
        np.testing.assert_array_equal(grid[:, column], plain[1][k * batch : (k + 1) * batch])


def test_dedup_and_route_rejects_a_bad_sample_major_layout() -> None:
    ids = np.arange(6, dtype=np.int64)
    starts = np.array([0, 6], dtype=np.int64)
    bucket_map = default_bucket_map(4, 1)
    with pytest.raises(ValueError, match="blocks of 4"):
        dedup_and_route(ids, starts, bucket_map, sample_major=(4, np.arange(2)))
    with pytest.raises(ValueError, match="permutation"):
        dedup_and_route(ids, starts, bucket_map, sample_major=(3, np.array([1, 1])))


def test_routed_without_order_splits_and_gathers_by_slices() -> None:
    ids = np.array([5, 9, 2, 7], dtype=np.int64)
    routed = Routed([ids[:1], ids[1:]], None, np.array([0, 1, 4]))
    values = np.arange(8.0).reshape(4, 2)
    parts = routed.split(values)
    assert parts[1].base is values or parts[1].base is values.base  # a view, no copy
    np.testing.assert_array_equal(routed.gather(parts), values)
    out = np.zeros_like(values)
    assert routed.gather(parts, out=out) is out
    np.testing.assert_array_equal(out, values)
