"""Bad input: the error a malformed row raises, and the bookkeeping of what was skipped instead.

Every reader reports a malformed row (wrong column count, unparsable number, a label that is not
0 or 1, a dense value that is not a finite number under the feature's `invalid: skip | raise`, bad
libfm token, missing label) through `BadRows.report`, which either raises `BadRowError` naming the
file, the line (or Parquet row), the field and the offending text, or, with `on_error: skip`, counts
the row, logs the first few and keeps a sample for `BatchReader.stats()`.

A unit (a byte range of a text file, a gzip file, a Parquet row group) that cannot be read to its
end, because the file is cut short, corrupt or unreadable, is reported through `BadRows.report_unit`:
it raises, or is counted apart from the skipped rows (`units_failed`, `bytes_lost`, `rows_lost`,
`failed_units`) and named in a warning; the rows read before the damage are kept.

Dense values that the reader changes under the feature's `invalid: fill` policy (NaN or infinite:
the fill value; beyond float32's range: the nearest float32) and missing values (filled as the
schema says) are counted per feature (`BadRows.count_values`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

MAX_TEXT = 200

Policy = Literal["raise", "skip"]


class BadRowError(ValueError):
    """A malformed row or unreadable file; `location` is "line N" (text), "row N" (Parquet), "file",
    "bytes A-B" (a text unit) or "row group N"."""

    def __init__(self, path: str, location: str, reason: str, text: str = "") -> None:
        self.path = path
        self.location = location
        self.reason = reason
        self.text = text
        shown = f": {text[:MAX_TEXT]!r}" if text else ""
        super().__init__(f"{path}, {location}: {reason}{shown}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str]]:
        # Pickles with its own arguments, so it crosses process boundaries (Ray actors) intact.
        return type(self), (self.path, self.location, self.reason, self.text)


@dataclass(frozen=True)
class SkippedRow:
    path: str
    location: str
    reason: str
    text: str

    def as_dict(self) -> dict[str, str]:
        return {"file": self.path, "location": self.location, "reason": self.reason, "text": self.text}


@dataclass(frozen=True)
class FailedUnit:
    """A unit not read to its end: `bytes_lost` bytes of the file as stored were never decoded
    (compressed bytes for gzip); `rows_lost` is known for Parquet row groups only."""

    path: str
    location: str
    reason: str
    bytes_lost: int
    rows_lost: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "location": self.location,
            "reason": self.reason,
            "bytes_lost": self.bytes_lost,
            "rows_lost": self.rows_lost,
        }


@dataclass
class Tally:
    """Everything a reader counted: skipped rows (with samples), failed units, changed dense values."""

    rows_skipped: int = 0
    samples: list[SkippedRow] = field(default_factory=list)
    failed_units: list[FailedUnit] = field(default_factory=list)
    missing: Counter[str] = field(default_factory=Counter)  # dense feature -> values missing (filled)
    filled: Counter[str] = field(default_factory=Counter)  # NaN / infinite values -> fill
    clipped: Counter[str] = field(default_factory=Counter)  # beyond float32 -> nearest float32

    def copy(self) -> Tally:
        return Tally(
            self.rows_skipped,
            list(self.samples),
            list(self.failed_units),
            Counter(self.missing),
            Counter(self.filled),
            Counter(self.clipped),
        )

    def since(self, earlier: Tally) -> Tally:
        """What was counted after `earlier` (a copy of this tally taken before)."""
        return Tally(
            self.rows_skipped - earlier.rows_skipped,
            self.samples[len(earlier.samples) :],
            self.failed_units[len(earlier.failed_units) :],
            self.missing - earlier.missing,
            self.filled - earlier.filled,
            self.clipped - earlier.clipped,
        )

    def as_dict(self) -> dict[str, Any]:
        """The counts as `BatchReader.stats()` reports them (plain JSON)."""
        names = sorted(set(self.missing) | set(self.filled) | set(self.clipped))
        return {
            "rows_skipped": self.rows_skipped,
            "skipped_samples": [sample.as_dict() for sample in self.samples],
            "units_failed": len(self.failed_units),
            "bytes_lost": sum(unit.bytes_lost for unit in self.failed_units),
            "rows_lost": sum(unit.rows_lost or 0 for unit in self.failed_units),
            "failed_units": [unit.as_dict() for unit in self.failed_units],
            "dense_values_missing": sum(self.missing.values()),
            "dense_values_filled": sum(self.filled.values()),
            "dense_values_clipped": sum(self.clipped.values()),
            "dense_values": {
                name: {
                    "missing": self.missing[name],
                    "filled": self.filled[name],
                    "clipped": self.clipped[name],
                }
                for name in names
            },
        }


class BadRows:
    """Raise on bad input, or count and sample it (thread-safe; shared by a reader's threads)."""

    def __init__(self, policy: Policy, *, max_samples: int = 20, max_logged: int = 5) -> None:
        self.policy = policy
        self.max_samples = max_samples
        self.max_logged = max_logged
        self.tally = Tally()
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Rows skipped so far."""
        return self.tally.rows_skipped

    @property
    def samples(self) -> list[SkippedRow]:
        return self.tally.samples

    def report(
        self,
        path: str,
        location: str | Callable[[], str],
        reason: str,
        text: str = "",
        *,
        policy: Policy | None = None,
    ) -> None:
        """Raise `BadRowError`, or (policy "skip") record the row; the caller then drops it.

        `location` may be a function, called only when the location is shown (finding a line number
        means counting the lines before it, which is kept off the path of rows skipped unsampled).
        `policy` overrides the reader's (a dense feature's own `invalid: skip | raise`).
        """
        if (policy or self.policy) == "raise":
            raise BadRowError(path, location if isinstance(location, str) else location(), reason, text)
        with self._lock:
            tally = self.tally
            tally.rows_skipped += 1
            shown = ""
            if len(tally.samples) < self.max_samples or tally.rows_skipped <= self.max_logged:
                shown = location if isinstance(location, str) else location()
            if len(tally.samples) < self.max_samples:
                tally.samples.append(SkippedRow(path, shown, reason, text[:MAX_TEXT]))
            if tally.rows_skipped <= self.max_logged:
                logger.warning("skipping bad row %s, %s: %s: %r", path, shown, reason, text[:MAX_TEXT])
            elif tally.rows_skipped == self.max_logged + 1:
                logger.warning("more bad rows skipped; see the reader's stats() for counts and samples")

    def report_unit(
        self, path: str, location: str, reason: str, *, bytes_lost: int, rows_lost: int | None = None
    ) -> None:
        """Raise `BadRowError`, or (policy "skip") record a unit not read to its end and name it in a
        warning; the rows read from it before the damage are kept."""
        if self.policy == "raise":
            raise BadRowError(path, location, reason)
        with self._lock:
            self.tally.failed_units.append(FailedUnit(path, location, reason, bytes_lost, rows_lost))
        lost = f"{rows_lost} rows" if rows_lost is not None else f"{bytes_lost} bytes"
        logger.warning(
            "could not read all of %s, %s: %s; %s lost (rows before the damage are kept; see the "
            "reader's stats()['failed_units'])",
            path,
            location,
            reason,
            lost,
        )

    def count_values(self, feature: str, *, missing: int = 0, filled: int = 0, clipped: int = 0) -> None:
        """Count values of dense feature `feature` that were missing, filled or clipped."""
        if not (missing or filled or clipped):
            return
        with self._lock:
            if missing:
                self.tally.missing[feature] += missing
            if filled:
                self.tally.filled[feature] += filled
            if clipped:
                self.tally.clipped[feature] += clipped

    def snapshot(self) -> Tally:
        """A copy of the counts so far (`Tally.since` of a later snapshot gives what came between)."""
        with self._lock:
            return self.tally.copy()

    def replay(self, counted: Tally) -> None:
        """Count again what reading a unit counted (a unit served from `PreparedCache`), re-logging
        its failed units."""
        with self._lock:
            tally = self.tally
            tally.rows_skipped += counted.rows_skipped
            room = max(0, self.max_samples - len(tally.samples))
            tally.samples.extend(counted.samples[:room])
            tally.missing.update(counted.missing)
            tally.filled.update(counted.filled)
            tally.clipped.update(counted.clipped)
        for unit in counted.failed_units:
            self.report_unit(
                unit.path, unit.location, unit.reason, bytes_lost=unit.bytes_lost, rows_lost=unit.rows_lost
            )
