"""Where the disk tier's next records go: the slab file as a log of fixed-size segments.

Random ``pwrite``s of single records are the disk tier's most expensive operation (each dirties
its own page and updates the file's times; about 5 us a record on the development machine, against
0.03 us a record for one sequential write of a batch). So demoted rows are never written back into
the slots they came from: every batch of records is appended at the log's head, one ``pwrite`` per
run of adjacent slots, and a row's previous slot becomes garbage.

The file is ``segments`` segments of ``segment_rows`` slots. ``SegmentLog`` keeps, per segment, the
number of live records in it and a generation (bumped each time the segment is reused, so a reader
can tell that a slot was rewritten since it was read); the head segment and how much of it is
written; and a stack of empty segments. A segment whose last live record goes (its row promoted or
removed) is empty at once. When no empty segment is left, the disk tier either cleans the sealed
segment with the fewest live records (reads it in one call and appends its live records again, so
at most ``CLEAN_MAX_LIVE / (1 - CLEAN_MAX_LIVE)`` records move per slot freed) or, when even that
segment is fuller than ``CLEAN_MAX_LIVE``, grows the file. The file therefore holds at most about
``1 / CLEAN_MAX_LIVE`` slots per live record, plus one growth step (``sizes.DISK_SPACE_FACTOR``).

Plain bookkeeping over NumPy arrays, no I/O: ``DiskTier`` does the reading and writing, and
``tests/embedding/test_slab_log.py`` checks the accounting against a per-slot reference.
"""

from __future__ import annotations

import numpy as np

SEGMENT_ROWS = 4096  # slots per segment: ~1.1 MiB of 288-byte records, read in one call when cleaned
MIN_SEGMENT_ROWS = 2
CLEAN_MAX_LIVE = 0.5  # clean a segment only if at most this share of its slots is live; else grow


def segment_rows_for(memory_rows: int) -> int:
    """Segment size for a table keeping `memory_rows` in memory: ``SEGMENT_ROWS``, smaller for small
    budgets (a quarter of the budget: a demotion, 5% of it, then fills part of one segment, and the
    small tables of the tests clean and reuse segments all the time)."""
    return max(MIN_SEGMENT_ROWS, min(SEGMENT_ROWS, memory_rows // 4))


class SegmentLog:
    """Slot allocation and per-segment live counts of an append-only slab (module docstring)."""

    def __init__(self, segment_rows: int = SEGMENT_ROWS) -> None:
        if segment_rows < 1:
            raise ValueError(f"segment_rows must be >= 1, got {segment_rows}")
        self.segment_rows = int(segment_rows)
        self.live = np.zeros(0, dtype=np.int64)  # per segment: live records
        self.generation = np.zeros(0, dtype=np.int64)  # per segment: times it became the head
        self._is_free = np.zeros(0, dtype=np.bool_)
        self._free: list[int] = []  # empty segments, the next head last
        self.head = -1
        self.head_fill = self.segment_rows  # slots written in the head segment (full: take another)

    @property
    def num_segments(self) -> int:
        return int(self.live.shape[0])

    @property
    def capacity(self) -> int:
        """Slots in the file."""
        return self.num_segments * self.segment_rows

    @property
    def live_rows(self) -> int:
        return int(self.live.sum())

    @property
    def free_segments(self) -> int:
        return len(self._free)

    @property
    def open_head(self) -> int:
        """The head segment while it still has unwritten slots, else -1 (a full head is sealed)."""
        return self.head if self.head_fill < self.segment_rows else -1

    def add_segments(self, count: int) -> None:
        """`count` new empty segments at the end of the file (the caller has grown the file)."""
        first = self.num_segments
        self.live = np.concatenate([self.live, np.zeros(count, dtype=np.int64)])
        self.generation = np.concatenate([self.generation, np.zeros(count, dtype=np.int64)])
        self._is_free = np.concatenate([self._is_free, np.ones(count, dtype=np.bool_)])
        self._free.extend(range(first + count - 1, first - 1, -1))  # lowest offset first

    def next_run(self, limit: int) -> tuple[int, int] | None:
        """(first slot, count) of up to `limit` adjacent slots at the head, counted live; None when
        the head is full and no segment is empty (clean one or add segments, then ask again)."""
        if self.head_fill == self.segment_rows:
            if not self._free:
                return None
            self.head = self._free.pop()
            self._is_free[self.head] = False
            self.generation[self.head] += 1
            self.head_fill = 0
        count = min(limit, self.segment_rows - self.head_fill)
        first = self.head * self.segment_rows + self.head_fill
        self.head_fill += count
        self.live[self.head] += count
        return first, count

    def release(self, slots: np.ndarray) -> None:
        """The records in `slots` (distinct, live) are garbage now; segments left empty are reused."""
        if slots.shape[0] == 0:
            return
        segments = slots // self.segment_rows
        self.live -= np.bincount(segments, minlength=self.num_segments)
        if int(self.live.min()) < 0:
            raise RuntimeError("disk tier: a slot was released twice")
        touched = np.unique(segments)
        empty = touched[(self.live[touched] == 0) & (touched != self.open_head)]
        for segment in empty.tolist():
            if not self._is_free[segment]:
                self._is_free[segment] = True
                self._free.append(segment)

    def cleaning_candidate(self) -> int | None:
        """The sealed segment with the fewest live records, if at most ``CLEAN_MAX_LIVE`` of it is
        live; None when the file should grow instead."""
        if self.num_segments == 0:
            return None
        live = self.live.copy()
        live[self._is_free] = self.segment_rows + 1
        if self.open_head >= 0:
            live[self.open_head] = self.segment_rows + 1
        segment = int(np.argmin(live))
        return segment if live[segment] <= CLEAN_MAX_LIVE * self.segment_rows else None

    def slots_of(self, segment: int) -> np.ndarray:
        first = segment * self.segment_rows
        return np.arange(first, first + self.segment_rows, dtype=np.int64)
