"""Complete lines of a text unit, in blocks of bytes, for the text format readers (csv/tsv, libfm).

A unit is a byte range [start, stop) of a file (or a whole gzip file). It owns the lines whose first
byte lies in the range: a unit starting at s > 0 skips to the first line start >= s, and reads past
`stop` to finish its last line. Resuming "after offset x" is the same rule with s = x + 1. Lines end
with LF or CRLF; a last line without a line end still counts (if it is cut short, the parser finds
it malformed). Byte offsets are of the uncompressed text.

Line numbers, which only error messages need, are found lazily by counting line ends from the start
of the file (`line_number`), so reading a unit never needs a line index.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from psrec.data.units import Unit, is_gzip

BLOCK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class LineBlock:
    """Whole lines `data` starting at byte `offset` of the file; `starts`/`ends`: non-blank lines.

    `ends` exclude the line end (LF or CRLF); blank lines (nothing before the line end) are left out.
    """

    data: bytes
    offset: int
    starts: np.ndarray  # (num_lines,) int64 start of each line within data
    ends: np.ndarray  # (num_lines,) int64 end of each line's content within data

    def line(self, index: int) -> str:
        raw = self.data[int(self.starts[index]) : int(self.ends[index])]
        return raw.decode("utf-8", errors="replace")


def line_spans(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(starts, content ends) of the non-blank lines of `data`."""
    array = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(array == 10)
    starts = np.concatenate(([0], newlines + 1)).astype(np.int64)
    ends = np.concatenate((newlines, [array.size])).astype(np.int64)
    if starts[-1] == array.size:  # data ends with a line end: no line after it
        starts, ends = starts[:-1], ends[:-1]
    carriage = (ends > starts) & (array[np.maximum(ends - 1, 0)] == 13) if array.size else ends > starts
    ends = ends - carriage
    keep = ends > starts
    return starts[keep], ends[keep]


def _open(path: str) -> pa.NativeFile:
    if is_gzip(path):
        return pa.input_stream(path, compression="gzip")
    return pa.input_stream(path, compression=None)


def _skip(stream: pa.NativeFile, count: int) -> int:
    skipped = 0
    while skipped < count:
        chunk = stream.read(min(BLOCK_BYTES, count - skipped))
        if not chunk:
            break
        skipped += len(chunk)
    return skipped


def line_blocks(
    unit: Unit, *, after: int | None = None, skip_header: bool = False, block_bytes: int = BLOCK_BYTES
) -> Iterator[LineBlock]:
    """Blocks of the lines owned by `unit` (after byte offset `after`), without the header line."""
    begin = unit.start if after is None else max(unit.start, after + 1)
    stop = unit.stop if unit.stop >= 0 else 1 << 62
    if begin >= stop:
        return
    compressed = is_gzip(unit.path)
    stream = pa.input_stream(unit.path, compression="gzip") if compressed else pa.OSFile(unit.path)
    try:
        position = 0
        if begin > 0 and compressed:
            position = _skip(stream, begin - 1)
        elif begin > 0:
            stream.seek(begin - 1)
            position = begin - 1
        need_line_start = begin > 0 or skip_header  # drop bytes up to and including the first line end
        pending = b""
        finished = False
        while not finished:
            chunk = stream.read(block_bytes)
            if not chunk:
                finished = True
                data, pending = pending, b""
            else:
                pending += chunk
                last = pending.rfind(b"\n")
                if last < 0:
                    continue
                data, pending = pending[: last + 1], pending[last + 1 :]
            if need_line_start:
                first = data.find(b"\n")
                if first < 0:  # end of file inside the line owned by the previous unit (or the header)
                    return
                position += first + 1
                data = data[first + 1 :]
                need_line_start = False
            if position >= stop:
                return
            if position + len(data) > stop:  # lines starting at or after `stop` belong to the next unit
                cut = data.find(b"\n", stop - position - 1)
                data = data if cut < 0 else data[: cut + 1]
                finished = True
            if data:
                starts, ends = line_spans(data)
                if starts.size:
                    yield LineBlock(data, position, starts, ends)
            position += len(data)
    finally:
        stream.close()


class LineCounter:
    """1-based line number of a byte offset, counting line ends from the file start.

    Offsets asked in increasing order continue from the previous one on the same open stream, so
    numbering the first bad rows of a gzip file decompresses it once, not once per row.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stream: pa.NativeFile | None = None
        self._offset = 0
        self._lines = 0

    def __call__(self, offset: int) -> int:
        with self._lock:
            if self._stream is None or offset < self._offset:
                if self._stream is not None:
                    self._stream.close()
                self._stream = _open(self.path)
                self._offset, self._lines = 0, 0
            remaining = offset - self._offset
            while remaining > 0:
                chunk = self._stream.read(min(BLOCK_BYTES, remaining))
                if not chunk:
                    break
                self._lines += chunk.count(b"\n")
                remaining -= len(chunk)
                self._offset += len(chunk)
            return self._lines + 1

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


def header_line(path: Path | str) -> str:
    """The first line of a (possibly gzip) text file, without its line end."""
    with _open(str(path)) as stream:
        data = b""
        while b"\n" not in data:
            chunk = stream.read(65536)
            if not chunk:
                break
            data += chunk
    return data.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8")
