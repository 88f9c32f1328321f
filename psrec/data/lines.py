"""Complete lines of a text unit, in blocks of bytes, for the text format readers (csv/tsv, libfm).

A unit is a byte range [start, stop) of a file (or a whole gzip file). It owns the lines whose first
byte lies in the range: a unit starting at s > 0 skips to the first line start >= s, and reads past
`stop` to finish its last line. Resuming "after offset x" is the same rule with s = x + 1. Lines end
with LF or CRLF; a last line without a line end still counts (if it is cut short, the parser finds
it malformed when a column is missing; a cut inside its last value cannot be told from a complete
value, since the schema fixes no widths). Byte offsets are of the uncompressed text.

Damage: gzip files are decompressed with zlib (`GzipStream`), so a file cut short or corrupt yields
every byte decoded before the damage. `line_blocks` then hands over every whole line before it and
raises `DamagedStream` with the unfinished line after them (a gzip stream that ends before its end
marker ends inside that line, whether or not it ends in a line end: the rule for telling a cut last
line) and how many bytes of the file were never decoded. Other read errors raise `DamagedStream`
too, with the position reached.

Line numbers, which only error messages need, are found lazily by counting line ends from the start
of the file (`line_number`), so reading a unit never needs a line index.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from psrec.data.errors import BadRowError, BadRows
from psrec.data.units import Unit, is_gzip

logger = logging.getLogger(__name__)

BLOCK_BYTES = 4 * 1024 * 1024
COMPRESSED_CHUNK = 1024 * 1024  # compressed bytes read at a time
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib reads the gzip header and trailer


class DamagedStream(OSError):
    """A text unit that cannot be read to its end.

    `reason`: what is wrong; `bytes_lost`: bytes of the file as stored after the damage (compressed
    bytes for gzip; 0 when a gzip stream ends early, since what is missing is unknown); `partial`:
    an unfinished line decoded before the damage, starting at uncompressed offset `partial_offset`.
    """

    def __init__(
        self, path: str, reason: str, *, bytes_lost: int, partial: bytes = b"", partial_offset: int = 0
    ) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.bytes_lost = bytes_lost
        self.partial = partial
        self.partial_offset = partial_offset


class _Readable(Protocol):
    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class GzipStream:
    """A gzip file's uncompressed bytes (every member, zero padding between them ignored).

    Unlike a stream that fails a whole read at the damage, `read` returns every byte decoded before
    a cut or a corrupt byte, and only the read after them raises `DamagedStream`.
    """

    def __init__(self, path: str, *, chunk: int = COMPRESSED_CHUNK, out_chunk: int = BLOCK_BYTES) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._size = os.fstat(self._file.fileno()).st_size
        self._chunk = chunk
        self._out_chunk = out_chunk
        self._inflate: zlib._Decompress | None = None
        self._input = b""  # compressed bytes read and not yet decoded
        self._read = 0  # compressed bytes read from the file
        self._output: deque[bytes] = deque()
        self._offset = 0  # bytes of the first output chunk already returned
        self._done = False
        self._error: DamagedStream | None = None

    def _fail(self, reason: str, unread: int) -> None:
        self._error = DamagedStream(self.path, reason, bytes_lost=unread)
        self._done = True

    def _decode(self, data: bytes) -> None:
        """Decode (some of) `data`, compressed bytes that end where the file's bytes read so far end."""
        assert self._inflate is not None
        before = self._inflate.copy()
        try:
            out = self._inflate.decompress(data, self._out_chunk)
        except zlib.error as error:
            # Keep what decodes: the longest prefix of `data` that decodes, found by bisection.
            low, high, out = 0, len(data), b""
            while high - low > 1:
                middle = (low + high) // 2
                trial = before.copy()
                try:
                    decoded = trial.decompress(data[:middle])
                except zlib.error:
                    high = middle
                else:
                    low, out = middle, decoded
            if out:
                self._output.append(out)
            self._fail(f"corrupt gzip data ({error})", self._size - (self._read - len(data) + low))
            return
        if out:
            self._output.append(out)
        if self._inflate.eof:  # end of a member: another may follow
            self._input = self._inflate.unused_data
            self._inflate = None
        else:
            self._input = self._inflate.unconsumed_tail

    def _fill(self) -> None:
        if not self._input:
            self._input = self._file.read(self._chunk)
            self._read += len(self._input)
            if not self._input:
                if self._inflate is not None:
                    self._fail("the gzip stream ends before its end marker: the file was cut short", 0)
                self._done = True
                return
        if self._inflate is None:  # between members: skip zero padding, then a new member
            self._input = self._input.lstrip(b"\0")
            if not self._input:
                return
            self._inflate = zlib.decompressobj(_GZIP_WBITS)
        self._decode(self._input)

    def read(self, size: int) -> bytes:
        """Up to `size` bytes (b"" at the end); `DamagedStream` once every byte before damage is read."""
        while not self._output and not self._done:
            self._fill()
        if not self._output:
            if self._error is not None:
                raise self._error
            return b""
        first = self._output[0]
        if self._offset == 0 and len(first) <= size:
            return self._output.popleft()
        out = first[self._offset : self._offset + size]
        self._offset += len(out)
        if self._offset == len(first):
            self._output.popleft()
            self._offset = 0
        return out

    def close(self) -> None:
        self._file.close()


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


def carriage_return_lines(block: LineBlock) -> np.ndarray:
    """Indices of the lines of `block` whose content holds a carriage return (one that does not end
    the line as part of CRLF). Parsers that take a lone CR for a line end would split such a line,
    or merge it with an empty one, so the readers refuse it instead."""
    data = block.data
    if b"\r" not in data or data.count(b"\r") == data.count(b"\r\n"):
        return np.zeros(0, np.int64)
    positions = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 13)
    line = np.searchsorted(block.starts, positions, side="right") - 1
    inside = (line >= 0) & (positions < block.ends[np.maximum(line, 0)])
    return np.unique(line[inside])


def _open(path: str) -> _Readable:
    if is_gzip(path):
        return GzipStream(path)
    return pa.OSFile(path)


def _skip(stream: _Readable, count: int) -> int:
    skipped = 0
    while skipped < count:
        chunk = stream.read(min(BLOCK_BYTES, count - skipped))
        if not chunk:
            break
        skipped += len(chunk)
    return skipped


def _stored_bytes(unit: Unit) -> int:
    """Bytes of `unit` as stored (a whole file for stop -1)."""
    if unit.stop >= 0:
        return unit.stop - unit.start
    try:
        return os.path.getsize(unit.path)
    except OSError:
        return 0


def line_blocks(
    unit: Unit, *, after: int | None = None, skip_header: bool = False, block_bytes: int = BLOCK_BYTES
) -> Iterator[LineBlock]:
    """Blocks of the lines owned by `unit` (after byte offset `after`), without the header line.

    A unit that cannot be read to its end raises `DamagedStream` after the blocks of every whole line
    before the damage; its `partial` is the unfinished line (if this unit owns it).
    """
    begin = unit.start if after is None else max(unit.start, after + 1)
    stop = unit.stop if unit.stop >= 0 else 1 << 62
    if begin >= stop:
        return
    position = 0
    try:
        compressed = is_gzip(unit.path)
        stream: _Readable
        if compressed:
            stream = GzipStream(unit.path)
        else:
            file = pa.OSFile(unit.path)
            if begin > 0:
                file.seek(begin - 1)
                position = begin - 1
            stream = file
    except OSError as error:
        raise DamagedStream(unit.path, f"unreadable file: {error}", bytes_lost=_stored_bytes(unit)) from error
    pending = b""
    need_line_start = begin > 0 or skip_header  # drop bytes up to and including the first line end
    try:
        if begin > 0 and compressed:
            position = _skip(stream, begin - 1)
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
    except OSError as error:
        if isinstance(error, DamagedStream):
            damage = error
        else:
            unread = max(0, (unit.stop if unit.stop >= 0 else _stored_bytes(unit)) - position - len(pending))
            damage = DamagedStream(unit.path, f"read error: {error}", bytes_lost=unread)
        # `pending` holds no line end: it is the unfinished line at the damage, unless it belongs to
        # a line before `begin` (still looking for a line start) or to the next unit.
        owned = not need_line_start and position < stop
        damage.partial = pending if owned and pending.rstrip(b"\r") else b""
        damage.partial_offset = position
        raise damage from (None if damage is error else error)
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
        self._stream: _Readable | None = None
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
    stream = _open(str(path))
    try:
        data = b""
        while b"\n" not in data:
            chunk = stream.read(65536)
            if not chunk:
                break
            data += chunk
    finally:
        stream.close()
    return data.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", errors="replace")


def has_data_line(path: Path | str, *, skip_header: bool = False) -> bool:
    """True when the file holds a non-blank line (after the header line with `skip_header`).

    Reads only up to that line. A file damaged before it counts as having one: reading it reports
    the damage.
    """
    if os.path.getsize(path) == 0:
        return False
    stream = _open(str(path))
    try:
        header = skip_header
        buffer = b""
        while True:
            chunk = stream.read(65536)
            *lines, buffer = (buffer + chunk).split(b"\n")  # the unfinished last line waits
            if not chunk:
                lines.append(buffer)  # the last line, without a line end
            for line in lines:
                if header:
                    header = False
                elif line.removesuffix(b"\r"):
                    return True
            if not chunk:
                return False
    except DamagedStream:
        return True
    finally:
        stream.close()


def check_not_empty(path: str, *, allow_empty: bool, skip_header: bool = False) -> bool:
    """True when text file `path` has a line to read; for one without, raise `BadRowError` (location
    "file"), or with `allow_empty` warn and return False."""
    if has_data_line(path, skip_header=skip_header):
        return True
    what = "only a header line" if skip_header and os.path.getsize(path) else "no rows"
    if not allow_empty:
        raise BadRowError(
            path, "file", f"the file has {what}: remove it from the source's paths, or set allow_empty: true"
        )
    logger.warning("%s has %s (allowed by allow_empty)", path, what)
    return False


def report_damage(errors: BadRows, counter: LineCounter, unit: Unit, damage: DamagedStream) -> None:
    """Report a unit that `line_blocks` could not read to its end: its unfinished last line as a bad
    row, then the unit itself (each raises under on_error "raise")."""
    if damage.partial:
        text = damage.partial.decode("utf-8", errors="replace")
        offset = damage.partial_offset
        reason = f"{damage.reason}, inside this line (a row cut short)"
        errors.report(unit.path, lambda: f"line {counter(offset)}", reason, text)
    location = f"bytes {unit.start}-{unit.stop}" if unit.stop >= 0 else "file"
    errors.report_unit(unit.path, location, damage.reason, bytes_lost=damage.bytes_lost)
