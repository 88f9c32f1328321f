"""A shard's durable log: every operation that changed the shard since its last checkpoint, in order.

A shard whose process dies is rebuilt alone from its file of the last checkpoint plus this log
(`psrec.ps.replay`), so the log holds exactly what the checkpoint does not: the training pulls
(they insert ids and count admissions), the pushes (gradients as they arrived on the wire) and the
maintenance calls that change tables (learning rates, eviction, snapshots) and the bucket moves of a
resharding (the rows that arrived, the buckets dropped), in the order the shard executed them. A record is written before the operation runs and before its caller hears back, so
every acknowledged push is in the log.

Layout, one directory per shard::

    LOG_DIR/shard-3/segment-000002.log     # newest segment: a base record, then operations
    LOG_DIR/shard-3/snapshot-best.npz      # in-memory snapshots older than the segment's base

A segment starts with a **base** record naming what the operations apply to: fresh tables, or a
checkpoint chain (and the shard's learning rates and pull counters at that point). At every committed
checkpoint the shard starts a new segment on it and deletes the older ones, so the log holds at most
the operations of `checkpoint.every_steps` steps.

Record framing: ``b"PSRL" | u32 header length | u64 payload length | u32 crc32 | header | payload``;
the header is JSON (`op`, its arguments, and each array's key, dtype and shape), the payload the
arrays' bytes back to back. A record is written with `os.writev` (one call, or several for a record
larger than one call takes) on a file opened for appending: a process killed at any instant leaves whole records plus at most one torn one at the end, which the reader
drops (its operation was never acknowledged, so its caller sends it again). With ``fsync`` every
record is also flushed to the device before the operation runs (durable against losing the
machine, not only the process: needed when LOG_DIR is shared storage that another node replays).

Tests: ``python -m pytest tests/ps/test_replay.py -q``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"PSRL"
_FRAME = struct.Struct("<4sIQI")  # magic, header bytes, payload bytes, crc32 of header + payload
_SEGMENT = re.compile(r"^segment-(\d{6})\.log$")
MAX_HEADER_BYTES = 1 << 24


class PushLogError(Exception):
    """A log that cannot be used (unreadable base, a record that does not decode)."""


@dataclass
class LogRecord:
    """One logged operation: its name, its JSON-able arguments and its arrays."""

    op: str
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode_record(record: LogRecord) -> list[bytes | memoryview]:
    """The record's frame, header and payload buffers (written with one writev)."""
    layout = []
    buffers: list[bytes | memoryview] = []
    payload = 0
    for key, array in record.arrays.items():
        contiguous = np.asarray(array)  # a 0-d array stays 0-d (np.ascontiguousarray makes it 1-d)
        if not contiguous.flags.c_contiguous:
            contiguous = contiguous.copy(order="C")
        if contiguous.dtype.hasobject:
            raise TypeError(f"push log: array {key!r} holds Python objects")
        layout.append([key, contiguous.dtype.str, list(contiguous.shape)])
        raw = contiguous.reshape(-1).view(np.uint8)  # (nbytes,)
        buffers.append(memoryview(raw))  # type: ignore[arg-type]
        payload += raw.nbytes
    header = json.dumps({"op": record.op, "meta": record.meta, "arrays": layout}).encode()
    crc = zlib.crc32(header)
    for buffer in buffers:
        crc = zlib.crc32(buffer, crc)
    return [_FRAME.pack(MAGIC, len(header), payload, crc), header, *buffers]


def _decode(header: bytes, payload: bytes) -> LogRecord:
    described = json.loads(header)
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for key, dtype, shape in described["arrays"]:
        kind = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        size = count * kind.itemsize
        arrays[key] = np.frombuffer(payload, dtype=kind, count=count, offset=offset).reshape(shape)
        offset += size
    if offset != len(payload):
        raise PushLogError(f"record {described['op']!r}: arrays take {offset} bytes of {len(payload)}")
    return LogRecord(described["op"], described["meta"], arrays)


@dataclass
class Segment:
    """A segment as read: its base, its whole operations, and where the whole records end."""

    path: Path
    number: int
    base: LogRecord
    records: list[LogRecord]
    valid_bytes: int
    torn: str | None  # why reading stopped before the end of the file (a torn last record), or None


def read_segment(path: Path) -> Segment:
    """Read every whole record of one segment; raises `PushLogError` when its base is unreadable."""
    data = path.read_bytes()
    records: list[LogRecord] = []
    offset = 0
    torn = None
    while offset < len(data):
        problem = None
        if len(data) - offset < _FRAME.size:
            problem = f"{len(data) - offset} bytes left, less than a record's frame"
        else:
            magic, header_bytes, payload_bytes, crc = _FRAME.unpack_from(data, offset)
            end = offset + _FRAME.size + header_bytes + payload_bytes
            if magic != MAGIC or header_bytes > MAX_HEADER_BYTES:
                problem = f"no record frame at byte {offset}"
            elif end > len(data):
                problem = (
                    f"record at byte {offset} is cut short ({len(data) - offset} of {end - offset} bytes)"
                )
            else:
                header = data[offset + _FRAME.size : offset + _FRAME.size + header_bytes]
                payload = data[offset + _FRAME.size + header_bytes : end]
                if zlib.crc32(payload, zlib.crc32(header)) != crc:
                    problem = f"record at byte {offset} fails its checksum"
                else:
                    records.append(_decode(header, payload))
                    offset = end
                    continue
        torn = problem
        break
    if not records or records[0].op != "base":
        raise PushLogError(f"{path}: no base record ({torn or 'empty file'})")
    match = _SEGMENT.match(path.name)
    number = int(match.group(1)) if match else -1
    return Segment(path, number, records[0], records[1:], offset, torn)


def segment_paths(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of every segment file in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _SEGMENT.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_segment(directory: Path) -> tuple[Segment | None, list[str]]:
    """The newest segment whose base record reads, and why newer ones were passed over.

    A segment is created with its base record (then fsynced) before older ones are deleted, so a
    process killed while starting a segment leaves the previous one whole: it is used then.
    """
    skipped: list[str] = []
    for _, path in reversed(segment_paths(directory)):
        try:
            return read_segment(path), skipped
        except (OSError, PushLogError, ValueError, KeyError) as error:
            skipped.append(f"{path.name}: {error}")
    return None, skipped


class PushLog:
    """Appends records to one shard's newest segment (see the module docstring)."""

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.records_written = 0
        self.bytes_written = 0
        self.seconds_writing = 0.0  # encoding, checksums and writes of `append`
        self._fd: int | None = None
        self._number = -1

    @property
    def segment_number(self) -> int:
        return self._number

    def start_segment(self, base: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> Path:
        """Begin a new segment whose operations apply to `base`; older segments are deleted after
        the new one's base record is on disk."""
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = segment_paths(self.directory)
        number = max([n for n, _ in existing] + [self._number]) + 1
        path = self.directory / f"segment-{number:06d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            os.writev(fd, encode_record(LogRecord("base", base, arrays or {})))
            os.fsync(fd)
            _fsync_directory(self.directory)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self._fd, self._number = fd, number
        for old, old_path in existing:
            if old < number:
                old_path.unlink(missing_ok=True)
        return path

    def continue_segment(self, segment: Segment) -> None:
        """Append after the whole records of a segment read back by `read_segment` (a torn last
        record is cut off first)."""
        self.close()
        if segment.torn is not None:
            logger.warning("%s: dropping a torn last record (%s)", segment.path, segment.torn)
            os.truncate(segment.path, segment.valid_bytes)
        self._fd = os.open(segment.path, os.O_WRONLY | os.O_APPEND)
        self._number = segment.number

    def append(self, op: str, meta: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> int:
        """Write one record; returns its size in bytes. Durable against a killed process on return
        (and against a lost machine with ``fsync``)."""
        if self._fd is None:
            raise PushLogError(f"{self.directory}: append before a segment was started")
        start = time.perf_counter()
        buffers = encode_record(LogRecord(op, meta, arrays or {}))
        size = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        _write_all(self._fd, buffers, size, self.directory)
        if self.fsync:
            os.fsync(self._fd)
        self.records_written += 1
        self.bytes_written += size
        self.seconds_writing += time.perf_counter() - start
        return size

    def retract(self, size: int) -> None:
        """Cut the last record (of `size` bytes) off again: its operation raised before it ran."""
        if self._fd is not None:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - size)
            self.records_written -= 1
            self.bytes_written -= size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, buffers: list[bytes | memoryview], size: int, directory: Path) -> None:
    """Write every buffer, in order, with as few writev calls as the kernel allows (one writev
    writes at most about 2 GiB and IOV_MAX buffers; a full disk raises OSError)."""
    views = [memoryview(b).cast("B") for b in buffers]
    written = 0
    while views:
        done = os.writev(fd, views[:1024])
        if done == 0:
            raise PushLogError(f"{directory}: wrote {written} of {size} bytes (is the disk full?)")
        written += done
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
