"""Exactly-once data accounting: which training rows a run has consumed, across restarts.

Row ids (the reader's global row indices) are kept as sorted, disjoint ``[start, stop)`` ranges:
rows are read in order within a unit, so the consumed rows of a whole run collapse to about one range
per unit plus the ragged edge of the shuffle buffer. Every checkpoint stores the ranges of the rows
its steps consumed, so a run that is resumed, or rolled back after a failure, counts each row once.

    ranges = id_ranges(np.array([5, 1, 2, 3, 9]))     # [[1, 4], [5, 6], [9, 10]]
    union_ranges(ranges, id_ranges(np.array([4])))    # [[1, 6], [9, 10]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

EMPTY = np.zeros((0, 2), dtype=np.int64)


def id_ranges(ids: np.ndarray) -> np.ndarray:
    """(K, 2) sorted, disjoint, non-adjacent [start, stop) ranges covering exactly the ids' values."""
    # Sorted, repeats kept (a gap of 0 stays inside its range): np.unique, which hashes, took 10-20x
    # a sort on the distinct ids of a run's rows.
    values = np.sort(np.asarray(ids, dtype=np.int64).ravel())
    if values.size == 0:
        return EMPTY.copy()
    breaks = np.flatnonzero(np.diff(values) > 1) + 1
    starts = values[np.concatenate([[0], breaks])]
    stops = values[np.concatenate([breaks - 1, [values.size - 1]])] + 1
    return np.stack([starts, stops], axis=1)


def union_ranges(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The ranges of the union of two range sets (either may overlap or touch the other)."""
    both = np.concatenate([a, b]).reshape(-1, 2)
    if both.shape[0] == 0:
        return EMPTY.copy()
    both = both[np.argsort(both[:, 0], kind="stable")]
    ends = np.maximum.accumulate(both[:, 1])
    first = np.concatenate([[True], both[1:, 0] > ends[:-1]])  # a gap before it: a new range starts
    starts = both[first, 0]
    last = np.concatenate([np.flatnonzero(first)[1:] - 1, [both.shape[0] - 1]])
    return np.stack([starts, ends[last]], axis=1)


def ranges_size(ranges: np.ndarray) -> int:
    return int((ranges[:, 1] - ranges[:, 0]).sum())


def ranges_to_json(ranges: np.ndarray) -> list[int]:
    return [int(value) for value in ranges.reshape(-1)]


def ranges_from_json(values: Any) -> np.ndarray:
    array = np.asarray(values if values is not None else [], dtype=np.int64)
    if array.size % 2:
        raise ValueError("row ranges must hold (start, stop) pairs")
    return array.reshape(-1, 2)
