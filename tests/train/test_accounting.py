"""Exactly-once data accounting: row-id ranges against Python sets, and a resumed run counting every
row once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.train.accounting import (
    id_ranges,
    ranges_from_json,
    ranges_size,
    ranges_to_json,
    union_ranges,
)
from psrec.train.loop import train
from tests.conftest import small_run_config

ids = st.lists(st.integers(min_value=0, max_value=200), max_size=60).map(lambda v: np.array(v, np.int64))


def covered(ranges: np.ndarray) -> set[int]:
    return {value for start, stop in ranges.tolist() for value in range(start, stop)}


@settings(max_examples=200, deadline=None)
@given(ids, ids)
def test_ranges_equal_the_sets_they_stand_for(a: np.ndarray, b: np.ndarray) -> None:
    ra, rb = id_ranges(a), id_ranges(b)
    assert covered(ra) == set(a.tolist()) and ranges_size(ra) == len(set(a.tolist()))
    union = union_ranges(ra, rb)
    assert covered(union) == set(a.tolist()) | set(b.tolist())
    assert ranges_size(union) == len(set(a.tolist()) | set(b.tolist()))
    starts, stops = union[:, 0], union[:, 1]
    assert (starts < stops).all() and (starts[1:] > stops[:-1]).all()  # sorted, disjoint, not touching
    np.testing.assert_array_equal(ranges_from_json(ranges_to_json(union)), union)
    np.testing.assert_array_equal(union_ranges(union, ra), union)  # idempotent


def test_worked_example() -> None:
    ranges = id_ranges(np.array([5, 1, 2, 3, 9]))
    assert ranges.tolist() == [[1, 4], [5, 6], [9, 10]]
    assert union_ranges(ranges, id_ranges(np.array([4]))).tolist() == [[1, 6], [9, 10]]


def test_a_resumed_run_counts_every_row_once(synthetic_sources: dict[str, Any], tmp_path: Path) -> None:
    """The driver stops after 30 steps without its summary (as when it is killed); the same command
    re-run resumes, and the unique count covers the rows consumed before the restart too."""
    run_dir = tmp_path / "run"
    settings = {"checkpoint.every_steps": 10, "training.log_every_steps": 5}
    first = train(small_run_config(synthetic_sources, run_dir, **settings, **{"training.max_steps": 30}))
    assert first["rows_consumed"] == first["rows_consumed_unique"] == 30 * 256
    (run_dir / "summary.json").unlink()
    resumed = train(small_run_config(synthetic_sources, run_dir, **settings))
    assert resumed["resumed_from"]["step"] == 30
    assert resumed["rows_consumed"] == resumed["rows_consumed_unique"] == 24_000
    # the rate is of this process's samples over its train seconds, not of the run's whole count
    trained_here = resumed["samples"] - first["samples"]
    assert 0 < trained_here < resumed["samples"]
    assert resumed["samples_per_second"] * resumed["train_seconds"] == pytest.approx(trained_here)
