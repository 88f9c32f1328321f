"""A growing directory or object-store prefix as a stream source: each new file read once, in order.

New files keep landing under a directory or prefix (``logs/dt=2026-12-07/hour=13/part-0001.parquet``
on local disk, ``s3://``, ``gs://``); a continuous training run reads each one as it appears and
resumes exactly after a crash. The contract is the Kafka source's (`psrec.data.kafka_source`): a
`BatchReader` whose producer blocks while it waits for new files and stops promptly when closed::

    source = DataSource(format="parquet", paths=["s3://bucket/logs/dt=*/hour=*/*.parquet"])
    with open_growing_reader(source, schema, batch_size=4096, shard=rank, num_shards=world,
                             growing=GrowingFiles(order="name"), max_batch_delay_s=30) as reader:
        for batch in reader:
            train_step(batch)
            checkpoint_data = reader.position()

Files. The source's `paths` are re-listed every `poll_seconds` (pyarrow.fs, through `psrec.storage`).
A path is a file, a directory or prefix (every file under it, at any depth) or a glob whose
directory parts may hold ``*``, ``[...]`` and ``**`` (any number of directories). A file or
directory whose name starts with one of `ignore_prefixes` (".", "_": hidden files, ``_SUCCESS``,
``_temporary/``) is never data. A file's name is its path under the pattern's fixed prefix
(``dt=2026-12-07/part-0001.parquet``). Format options and `on_error` apply as for finished files:
the text formats read local files, Parquet also a store; a bad row or file is skipped and counted
(`on_error: skip`, the stream goes on) or raises naming the file and line. Files are expected to be
immutable once settled: one rewritten after it was read is not read again. A listing that fails
after the first is logged and tried again at the next poll.

Dealing and order. A file belongs to shard ``crc32(name) % num_shards`` (`shard_of`): the shares are
disjoint, cover every file and do not depend on when files arrive. Each shard reads its files in
order of name (lexicographic; ties by pattern) or of modification time (ties by name), each once
its size and modification time stayed the same for `settle_seconds` (so a file still being written
in place is not read half); an unsettled file holds back the files after it. A file that lands
after files ordered after it were read (a late arrival) is read next and counted (`files_late`).

Position (plain JSON, what a checkpoint stores), bounded over days of files::

    {"version": 1, "format": "growing", "order": "name", "shard": 0, "num_shards": 2,
     "watermark": ["dt=2026-12-07/part-0007.csv", 0],     # order key of the highest file read
     "recent": [["dt=2026-12-07/part-0007.csv", 0, 1796617087653], ...],  # name, pattern, mtime ms
     "current": {"file": ["dt=2026-12-07/part-0009.csv", 0, 1796617090001], "unit": 1, "after": 5230},
     "file_number": 9, "newest_event_ms": 1796617090001}

``current`` is the file being read, its unit and the offset of the last row delivered (as in
`psrec.data.reader`), or null between files. ``recent`` lists the files read whose modification time
is within `lateness_seconds` of ``newest_event_ms`` (the modification time of the newest file read:
the event-time proxy of freshness). Reopening with a position reads the current file on from there,
then every file not read: one in ``recent`` was read; one ordered at or before the watermark and
older than the lateness window is taken as read; any other is read. So every row is delivered
once, except a late file that lands while no reader runs and is older than the lateness window
(taken as read: raise `lateness_seconds` when files may land that late). Row ids are
``(file_number * num_shards + shard) mod 2**23 << 40 | offset``, numbered in reading order.

Ends. With `max_batch_delay_s`, rows waiting longer than that in a partial batch are delivered as a
short batch; otherwise batches are full except the last. With `idle_timeout_s` the source ends once
nothing of its shard is pending and no file appeared or changed for that long; without it, it waits
until closed. `stats()` adds files_read, files_pending (listed, not read yet), files_late.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs

from psrec.data.background import InputGate, checkpoint
from psrec.data.batch import Batch
from psrec.data.errors import BadRows
from psrec.data.features import ROW_ID, is_prepared, prepare_table, table_to_batch
from psrec.data.reader import BatchReader, make_format_reader
from psrec.data.schema import DataSource, GrowingFiles, Order, Schema
from psrec.data.units import OFFSET_BITS, OFFSET_MASK
from psrec.storage import Location, StorageError, StoragePath, filesystem, is_uri, location

logger = logging.getLogger(__name__)

POSITION_VERSION = 1
FILE_NUMBER_BITS = 63 - OFFSET_BITS  # row ids stay non-negative int64
WAIT_SLICE_S = 0.05  # how often a waiting source checks for close and for a batch overdue
Identity = tuple[str, int]  # (name, pattern index)


@dataclass(frozen=True)
class ListedFile:
    """A file found under a pattern: its name under the pattern's fixed prefix, and what listing said."""

    name: str
    pattern: int
    location: Location
    size: int
    mtime_ms: int

    @property
    def identity(self) -> Identity:
        return (self.name, self.pattern)

    def key(self, order: Order) -> tuple[Any, ...]:
        return (self.name, self.pattern) if order == "name" else (self.mtime_ms, self.name, self.pattern)

    def reference(self) -> list[Any]:
        return [self.name, self.pattern, self.mtime_ms]


def shard_of(name: str, num_shards: int) -> int:
    """The shard that reads the file named `name` (stable across processes and arrival orders)."""
    return zlib.crc32(name.encode()) % num_shards


def matches(segments: Sequence[str], parts: Sequence[str]) -> bool:
    """True when path segments match glob segments (``**``: any number of segments)."""
    if not parts:
        return not segments
    if parts[0] == "**":
        return any(matches(segments[skip:], parts[1:]) for skip in range(len(segments) + 1))
    return bool(segments) and fnmatch.fnmatchcase(segments[0], parts[0]) and matches(segments[1:], parts[1:])


@dataclass(frozen=True)
class _Pattern:
    """A path of the source split into its fixed prefix (a local path or a URI) and glob segments."""

    text: str
    prefix: str
    parts: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, base_dir: Path) -> _Pattern:
        if is_uri(text):
            scheme, rest = text.split("://", 1)
            head, segments = f"{scheme}://", rest.rstrip("/").split("/")
        else:
            path = location(text)
            assert isinstance(path, Path)
            full = path if path.is_absolute() else base_dir / path
            head, segments = "", full.as_posix().rstrip("/").split("/")
        fixed = next((i for i, segment in enumerate(segments) if glob.has_magic(segment)), len(segments))
        if is_uri(text) and fixed == 0:
            raise ValueError(f"{text}: the bucket of a store URI cannot be a glob")
        return cls(text, head + "/".join(segments[:fixed]), tuple(segments[fixed:]))

    def list(self, index: int, ignore: tuple[str, ...]) -> list[ListedFile]:
        try:
            fs, root = (
                filesystem(self.prefix) if is_uri(self.prefix) else (pafs.LocalFileSystem(), self.prefix)
            )
            if not self.parts:
                info = fs.get_file_info(root)
                if info.type == pafs.FileType.File:  # the pattern names one file
                    return [self._listed(index, info.base_name, info)]
            selector = pafs.FileSelector(root, allow_not_found=True, recursive=True)
            infos = fs.get_file_info(selector)
        except (OSError, pa.ArrowException) as error:
            raise StorageError(f"{self.text}: cannot list it: {error}") from error
        found = []
        for info in infos:
            name = info.path[len(root) :].lstrip("/")
            segments = name.split("/")
            if info.type != pafs.FileType.File or any(segment.startswith(ignore) for segment in segments):
                continue
            if self.parts and not matches(segments, self.parts):
                continue
            found.append(self._listed(index, name, info))
        return found

    def locate(self, name: str) -> Location:
        """Where the file `name` of this pattern is (the pattern itself when it names one file)."""
        names_file = not self.parts and self.prefix.rsplit("/", 1)[-1] == name
        where = self.prefix if names_file else f"{self.prefix}/{name}"
        return StoragePath(where) if is_uri(where) else Path(where)

    def _listed(self, index: int, name: str, info: pafs.FileInfo) -> ListedFile:
        mtime_ms = int(info.mtime_ns or 0) // 1_000_000
        return ListedFile(name, index, self.locate(name), int(info.size or 0), mtime_ms)


class _Piece(NamedTuple):
    """Rows of one file read, and the position after the first n of them (`at(n)`)."""

    table: pa.Table
    at: Callable[[int], dict[str, Any]]


class _Follower:
    """Lists a shard's files, decides what to read next, reads it, and keeps the position."""

    def __init__(
        self,
        source: DataSource,
        schema: Schema,
        growing: GrowingFiles,
        errors: BadRows,
        *,
        shard: int,
        num_shards: int,
        base_dir: Path,
        idle_timeout_s: float | None,
        info: dict[str, Any],
    ) -> None:
        self.source, self.schema, self.growing, self.errors = source, schema, growing, errors
        self.shard, self.num_shards, self.idle_timeout_s, self.info = shard, num_shards, idle_timeout_s, info
        self.patterns = [_Pattern.parse(text, base_dir) for text in source.paths]
        self.identity = {
            "version": POSITION_VERSION,
            "format": "growing",
            "order": growing.order,
            "shard": shard,
            "num_shards": num_shards,
        }
        self.watermark: tuple[Any, ...] | None = None
        self.recent: dict[Identity, int] = {}  # files read within the lateness window -> mtime ms
        self._recent_sorted: list[list[Any]] | None = None
        self.newest_ms: int | None = None
        self.file_number = 0
        self.read: set[Identity] = set()  # every file read (or taken as read) by this reader
        self.pending: dict[Identity, ListedFile] = {}
        self.changes: dict[Identity, tuple[tuple[int, int], float]] = {}  # (size, mtime), since when
        self.resume: tuple[ListedFile, int, int | None] | None = None
        self.last_activity = time.monotonic()
        self.next_listing = 0.0

    def _list(self) -> list[ListedFile]:
        ignore = tuple(self.growing.ignore_prefixes)
        files: dict[str, ListedFile] = {}
        for index, pattern in enumerate(self.patterns):
            for found in pattern.list(index, ignore):
                if shard_of(found.name, self.num_shards) == self.shard:
                    files.setdefault(str(found.location), found)  # a file two patterns match: the first's
        return list(files.values())

    def _refresh(self, listing: list[ListedFile] | None = None) -> None:
        self.next_listing = time.monotonic() + self.growing.poll_seconds
        if listing is None:
            try:
                listing = self._list()
            except StorageError as error:  # a store's hiccup: try again at the next poll
                logger.warning("listing the growing source failed (retried): %s", error)
                return
        now = time.monotonic()
        self.pending = {f.identity: f for f in listing if f.identity not in self.read}
        for identity, found in self.pending.items():
            signature = (found.size, found.mtime_ms)
            seen = self.changes.get(identity)
            if seen is None or seen[0] != signature:
                self.changes[identity] = (signature, now)
                self.last_activity = now
        self.changes = {identity: self.changes[identity] for identity in self.pending}
        self.info["files_pending"] = len(self.pending)

    def start(self, position: dict[str, Any] | None) -> dict[str, Any]:
        """List the files, restore `position` (see the module docstring); returns the position."""
        listing = self._list()
        if position is not None:
            for key, value in self.identity.items():
                if position.get(key) != value:
                    raise ValueError(
                        f"position does not belong to this reader: {key} is {position.get(key)!r} there, "
                        f"{value!r} here (a position resumes the same source, order, shard and num_shards)"
                    )
            self.watermark = tuple(position["watermark"]) if position.get("watermark") else None
            self.recent = {(name, int(pattern)): int(ms) for name, pattern, ms in position.get("recent", [])}
            self.newest_ms = position.get("newest_event_ms")
            self.file_number = int(position.get("file_number", 0))
            horizon = (self.newest_ms or 0) - self.growing.lateness_seconds * 1000
            current: dict[str, Any] | None = position.get("current")
            current_identity = (current["file"][0], int(current["file"][1])) if current else None
            for found in listing:
                old = self.watermark is not None and found.key(self.growing.order) <= self.watermark
                if current is not None and found.identity == current_identity:
                    self.resume = (found, int(current["unit"]), current["after"])
                elif found.identity in self.recent or (old and found.mtime_ms < horizon):
                    self.read.add(found.identity)
            if current is not None and self.resume is None:  # gone: reading it raises or is counted
                name, index, mtime_ms = current["file"]
                gone = ListedFile(name, index, self.patterns[index].locate(name), 0, mtime_ms)
                self.resume = (gone, int(current["unit"]), current["after"])
            if self.resume is not None:
                self.read.add(self.resume[0].identity)
        self._refresh(listing)
        if self.resume is None:
            return self.position(None)
        found, unit, after = self.resume
        return self.position({"file": found.reference(), "unit": unit, "after": after}, found.mtime_ms)

    def position(self, current: dict[str, Any] | None, newest_ms: int | None = None) -> dict[str, Any]:
        newest = max((ms for ms in (self.newest_ms, newest_ms) if ms is not None), default=None)
        return {
            **self.identity,
            "watermark": list(self.watermark) if self.watermark is not None else None,
            "recent": self._recent_list(),
            "current": current,
            "file_number": self.file_number,
            "newest_event_ms": newest,
        }

    def _recent_list(self) -> list[list[Any]]:
        if self._recent_sorted is None:  # sorted once per file read, not per batch
            self._recent_sorted = sorted([name, pattern, ms] for (name, pattern), ms in self.recent.items())
        return [list(entry) for entry in self._recent_sorted]

    def _position_in(self, found: ListedFile, unit: int, table: pa.Table, rows: int) -> dict[str, Any]:
        after = int(table.column(ROW_ID)[rows - 1].as_py()) & OFFSET_MASK
        current = {"file": found.reference(), "unit": unit, "after": after}
        return self.position(current, found.mtime_ms)

    def _complete(self, found: ListedFile) -> None:
        key = found.key(self.growing.order)
        self.watermark = key if self.watermark is None or key > self.watermark else self.watermark
        self.newest_ms = found.mtime_ms if self.newest_ms is None else max(self.newest_ms, found.mtime_ms)
        horizon = self.newest_ms - self.growing.lateness_seconds * 1000
        self.recent[found.identity] = found.mtime_ms
        self.recent = {identity: ms for identity, ms in self.recent.items() if ms >= horizon}
        self._recent_sorted = None
        self.file_number += 1
        self.info["files_read"] += 1

    def _next_file(self) -> ListedFile | None:
        if not self.pending:
            return None
        first = min(self.pending.values(), key=lambda f: f.key(self.growing.order))
        _, since = self.changes[first.identity]
        return first if time.monotonic() - since >= self.growing.settle_seconds else None

    def _read(self, found: ListedFile, first_unit: int, after: int | None) -> Iterator[_Piece]:
        """The prepared rows of one file from unit `first_unit` after offset `after`; then the file
        counts as read. A file that cannot be read raises, or (on_error: skip) is counted as failed."""
        self.read.add(found.identity)
        self.pending.pop(found.identity, None)
        self.info["files_pending"] = len(self.pending)
        key = found.key(self.growing.order)
        if self.watermark is not None and key < self.watermark and first_unit == 0 and after is None:
            self.info["files_late"] += 1
            logger.info("%s arrived late (ordered before files read already): reading it now", found.location)
        slot = (self.file_number * self.num_shards + self.shard) % (1 << FILE_NUMBER_BITS)
        delivered = False
        try:
            reader = make_format_reader(self.source, self.schema, [found.location], self.errors)
            units = [replace(unit, file_index=slot) for unit in reader.units()]
            for index in range(first_unit, len(units)):
                for table in reader.read(units[index], after if index == first_unit else None):
                    checkpoint()  # a closed reader stops here; a held input gate pauses here
                    if table.num_rows and not is_prepared(table):
                        table = prepare_table(self.schema, table, self.errors)
                    if table.num_rows:
                        delivered = True
                        yield _Piece(table, functools.partial(self._position_in, found, index, table))
        except (OSError, ValueError, TypeError, pa.ArrowException) as error:  # BadRowError included
            if self.errors.policy == "raise":
                raise
            lost = 0 if delivered else found.size
            self.errors.report_unit(str(found.location), "file", f"cannot read it: {error}", bytes_lost=lost)
        self._complete(found)

    def pieces(self) -> Iterator[_Piece | None]:
        """Rows as they are read, file by file; None while waiting for a file (see `_batches`)."""
        if self.resume is not None:
            yield from self._read(*self.resume)
        while True:
            checkpoint()
            if time.monotonic() >= self.next_listing:
                self._refresh()
            found = self._next_file()
            if found is not None:
                yield from self._read(found, 0, None)
                continue
            idle = self.idle_timeout_s
            if idle is not None and not self.pending and time.monotonic() - self.last_activity >= idle:
                self._refresh()  # a last look before ending
                if not self.pending:
                    logger.info("no new file for %.1f s: the growing source ends", idle)
                    return
                continue
            yield None
            time.sleep(max(0.0, min(WAIT_SLICE_S, self.next_listing - time.monotonic())))


def _batches(
    pieces: Iterator[_Piece | None],
    position: Callable[[], dict[str, Any]],
    *,
    batch_size: int,
    max_batch_delay_s: float | None,
) -> Iterator[tuple[pa.Table, dict[str, Any]]]:
    """Cut the rows into tables of `batch_size` rows, each with the position after it; rows that
    waited `max_batch_delay_s` in a partial batch go out as a short one, as do the last rows."""
    pending: list[pa.Table] = []
    count = 0
    since = 0.0  # when the oldest row of the partial batch was read
    for piece in pieces:
        if piece is not None:
            taken, rows = 0, piece.table.num_rows
            if count == 0:
                since = time.monotonic()
            while taken < rows:
                take = min(batch_size - count, rows - taken)
                pending.append(piece.table.slice(taken, take))
                count, taken = count + take, taken + take
                if count == batch_size:
                    yield pa.concat_tables(pending), piece.at(taken)
                    pending, count, since = [], 0, time.monotonic()
        overdue = max_batch_delay_s is not None and time.monotonic() - since >= max_batch_delay_s
        if count and overdue:
            yield (
                pa.concat_tables(pending),
                piece.at(piece.table.num_rows) if piece is not None else position(),
            )
            pending, count = [], 0
    if pending:
        yield pa.concat_tables(pending), position()


def open_growing_reader(
    source: DataSource,
    schema: Schema,
    *,
    batch_size: int,
    shard: int = 0,
    num_shards: int = 1,
    growing: GrowingFiles | None = None,
    position: dict[str, Any] | None = None,
    max_batch_delay_s: float | None = None,
    idle_timeout_s: float | None = None,
    base_dir: str | Path = ".",
    prefetch: int = 2,
    gate: InputGate | None = None,
) -> BatchReader:
    """Follow the files of `source` that shard `shard` of `num_shards` is dealt, as batches of
    `batch_size` rows; see the module docstring.

    growing: how the files are followed (`GrowingFiles`; default: by name, listed every second).
    position: `reader.position()` of an earlier reader of the same source, order, shard and
    num_shards. max_batch_delay_s: the longest rows wait in a partial batch. idle_timeout_s: end
    when no file appeared for this long. base_dir, prefetch, gate: as `open_reader`'s.
    """
    growing = growing or GrowingFiles()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
    for name, value in (("max_batch_delay_s", max_batch_delay_s), ("idle_timeout_s", idle_timeout_s)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if source.format == "interactions":
        raise ValueError("the interactions format needs each user's whole history: it cannot grow")
    if source.format != "parquet" and any(is_uri(path) for path in source.paths):
        raise ValueError(f"format {source.format!r} reads local files only; a store needs Parquet")
    errors = BadRows(source.on_error)
    info: dict[str, Any] = {"paths": list(source.paths), "files_read": 0, "files_pending": 0, "files_late": 0}
    follower = _Follower(
        source,
        schema,
        growing,
        errors,
        shard=shard,
        num_shards=num_shards,
        base_dir=Path(base_dir),
        idle_timeout_s=idle_timeout_s,
        info=info,
    )
    start = follower.start(position)

    def produce() -> Iterator[tuple[Batch, dict[str, Any]]]:
        tables = _batches(
            follower.pieces(),
            lambda: follower.position(None),
            batch_size=batch_size,
            max_batch_delay_s=max_batch_delay_s,
        )
        for table, after in tables:
            yield table_to_batch(schema, table), after

    return BatchReader(produce, position=start, prefetch=prefetch, errors=errors, info=info, gate=gate)
