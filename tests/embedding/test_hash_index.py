"""HashIndex against a Python dict, including int64 extremes, growth, churn and slot reuse."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.embedding import HashIndex
from psrec.embedding.hash_index import MAX_LOAD

INT64 = st.integers(min_value=np.iinfo(np.int64).min, max_value=np.iinfo(np.int64).max)
SMALL = st.integers(min_value=-40, max_value=40)
KEYS = st.one_of(INT64, SMALL, st.sampled_from([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0]))
OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["insert", "lookup", "remove"]), st.lists(KEYS, max_size=40)), max_size=25
)


def _check_against(index: HashIndex, reference: dict[int, int]) -> None:
    assert index.num_rows == len(reference)
    live = index.live_rows()
    assert sorted(live.tolist()) == sorted(reference.values())
    assert sorted(index.keys[live].tolist()) == sorted(reference)
    assert index.num_rows <= MAX_LOAD * index.slots.shape[0]


@settings(max_examples=150, deadline=None)
@given(OPERATIONS)
def test_random_operations_match_a_dict(operations) -> None:
    index = HashIndex()
    reference: dict[int, int] = {}
    for operation, keys in operations:
        ids = np.array(keys, dtype=np.int64)
        if operation == "insert":
            rows, inserted = index.insert(ids)
            new_keys = set()
            for key, row, fresh in zip(keys, rows.tolist(), inserted.tolist(), strict=True):
                if key in reference:
                    assert row == reference[key] and not fresh
                else:
                    assert fresh and key not in new_keys
                    assert row not in reference.values()
                    reference[key] = row
                    new_keys.add(key)
        elif operation == "lookup":
            rows, missing = index.lookup(ids)
            assert rows.tolist() == [reference.get(key, -1) for key in keys]
            assert missing == sum(key not in reference for key in keys)
        else:
            freed = index.remove(ids)
            for key, row in zip(keys, freed.tolist(), strict=True):
                assert row == reference.pop(key, -1)
        _check_against(index, reference)


def test_freed_rows_are_reused_before_new_ones() -> None:
    index = HashIndex()
    rows, _ = index.lookup_or_insert(np.arange(10, dtype=np.int64))
    index.remove(np.array([2, 5], dtype=np.int64))
    new_rows, inserted = index.insert(np.array([100, 101, 102], dtype=np.int64))
    assert inserted.all()
    assert set(new_rows[:2].tolist()) == {int(rows[2]), int(rows[5])}
    assert new_rows[2] == 10


def test_churn_keeps_lookups_correct_after_growth() -> None:
    generator = np.random.default_rng(0)
    index = HashIndex()
    reference: dict[int, int] = {}
    for _ in range(20):
        ids = generator.integers(-5000, 5000, size=2000).astype(np.int64)
        rows, _ = index.lookup_or_insert(ids)
        reference.update(zip(ids.tolist(), rows.tolist(), strict=True))
        doomed = generator.integers(-5000, 5000, size=1500).astype(np.int64)
        index.remove(doomed)
        for key in doomed.tolist():
            reference.pop(key, None)
        probe = generator.integers(-6000, 6000, size=3000).astype(np.int64)
        assert index.lookup(probe)[0].tolist() == [reference.get(key, -1) for key in probe.tolist()]
    _check_against(index, reference)


def test_ids_digest_changes_with_any_id_or_their_order() -> None:
    from psrec.embedding.hash_index import ids_digest

    ids = np.random.default_rng(0).integers(-(2**62), 2**62, size=1000, dtype=np.int64)
    digest = ids_digest(ids)
    assert digest == ids_digest(ids.copy())
    changed = ids.copy()
    changed[500] += 1
    swapped = ids.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    others = {ids_digest(changed), ids_digest(swapped), ids_digest(ids[:-1]), ids_digest(ids[:0])}
    assert digest not in others and len(others) == 4
