"""Bad input: the error a malformed row raises, and the bookkeeping of rows skipped instead.

Every reader reports a malformed row (wrong column count, unparsable number, bad libfm token,
missing label, unreadable file) through `BadRows.report`, which either raises `BadRowError`
naming the file, the line (or Parquet row) and the offending text, or, with `on_error: skip`,
counts the row, logs the first few and keeps a sample for `BatchReader.stats()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

MAX_TEXT = 200


class BadRowError(ValueError):
    """A malformed row or unreadable file; `location` is "line N" (text) or "row N" (Parquet)."""

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


class BadRows:
    """Raise on a bad row, or count and sample it (thread-safe; shared by a reader's threads)."""

    def __init__(
        self, policy: Literal["raise", "skip"], *, max_samples: int = 20, max_logged: int = 5
    ) -> None:
        self.policy = policy
        self.max_samples = max_samples
        self.max_logged = max_logged
        self.count = 0
        self.samples: list[SkippedRow] = []
        self._lock = threading.Lock()

    def report(self, path: str, location: str | Callable[[], str], reason: str, text: str = "") -> None:
        """Raise `BadRowError`, or (policy "skip") record the row; the caller then drops it.

        `location` may be a function, called only when the location is shown (finding a line number
        means counting the lines before it, which is kept off the path of rows skipped unsampled).
        """
        if self.policy == "raise":
            raise BadRowError(path, location if isinstance(location, str) else location(), reason, text)
        with self._lock:
            self.count += 1
            shown = ""
            if len(self.samples) < self.max_samples or self.count <= self.max_logged:
                shown = location if isinstance(location, str) else location()
            if len(self.samples) < self.max_samples:
                self.samples.append(SkippedRow(path, shown, reason, text[:MAX_TEXT]))
            if self.count <= self.max_logged:
                logger.warning("skipping bad row %s, %s: %s: %r", path, shown, reason, text[:MAX_TEXT])
            elif self.count == self.max_logged + 1:
                logger.warning("more bad rows skipped; see the reader's stats() for counts and samples")
