"""The disk tier of a table: cold rows as fixed-size records in a log-structured slab file.

A record holds everything a row has in memory, bytes as stored: the payload at its precision (fp32,
fp16, or int8 codes plus scale and offset), the optimizer state, ``[count, last step]``, the row's
id and a 64-bit checksum of the rest. ``RecordLayout`` describes the fields; ``DiskTier`` keeps

- the slab: records in one file under the table's ``disk_dir``, written only by appending a batch
  at the head of a log of segments (``slab_log``: a demoted row never goes back to the slot it came
  from, so a batch of demotions is a few sequential ``pwrite``s, not one random write per row) and
  read a batch at a time by numba kernels that issue ``pread``s in file order, one call per run of
  adjacent slots, without the GIL (never one Python-level read per id). Segments whose records are
  mostly garbage are cleaned (their live records appended again) before the file grows;
- in memory, per cold row: its slot (a ``HashIndex`` id -> entry, and the entry's slot), its count
  and last step (so eviction, deltas and the demotion policy never read the disk), about 28 bytes a
  row (``sizes.DISK_INDEX_BYTES_PER_ROW``). A promoted row keeps its entry, marked resident (slot
  -1: its copy in memory is the current one) and its old slot becomes garbage; only ``remove``
  frees entries;
- at most one prefetch: ``prefetch(ids)`` starts reading the records of those ids on a background
  thread (the kernels release the GIL), and the next read takes each prefetched record whose slot
  is still the row's current slot and whose segment has not been reused since (``SegmentLog``
  generations), so a row rewritten after its prefetch is always read fresh.

Why a slab and not LMDB or RocksDB: ``psrec/bench/disk_store_choice.py`` (docs/benchmarks.md,
"Disk tier") reads 100k random rows 18x faster and writes demotions 1.2-1.9x faster than either.

The file is created under a unique name and unlinked at once: it lives as long as the process holds
it, a killed shard leaves nothing behind, and a new one starts an empty file (its rows come back
from the checkpoint). The file grows by ``posix_fallocate``, so a full disk is an ``OSError`` naming
the directory when the tier grows, never a ``SIGBUS`` at a later write. Every read verifies each
record's checksum and id; a mismatch (a torn or corrupted record) raises instead of returning the
row. The file is never memory-mapped, so it adds nothing to the shard's resident memory: its pages
live in the kernel's page cache, which the kernel gives back under memory pressure. (A mapped slab
adds the page-cache folios behind every touched record to the process's resident set; on kernels
with large page-cache folios one random 288-byte read maps hundreds of KiB, and dropping them again
costs as much as the reads.) Records are packed and moved ``CHUNK_ROWS`` at a time, so a batch's
temporaries stay a few MiB however many rows it moves.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from psrec.embedding.arrays import grow_rows
from psrec.embedding.hash_index import HashIndex
from psrec.embedding.hashing import GOLDEN_GAMMA, mix64
from psrec.embedding.optimizers import STATE_LAYOUT
from psrec.embedding.slab_log import SEGMENT_ROWS, SegmentLog
from psrec.embedding.state import PAYLOAD_DTYPES

CHECKSUM_SEED = 0xD15C_71E2
SLAB_GROWTH = 1.25  # the file grows by this factor (at least one segment) when cleaning cannot free one
MAX_SLOTS = 2**31 - 1  # slots are int32
CHUNK_ROWS = 65_536  # records packed, read or written at a time (bounds the temporaries)

_LIBC = ctypes.CDLL(None, use_errno=True)
_PREAD = _LIBC.pread
_PREAD.restype = ctypes.c_ssize_t
_PREAD.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ssize_t]
_PWRITE = _LIBC.pwrite
_PWRITE.restype = ctypes.c_ssize_t
_PWRITE.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ssize_t]


@numba.njit(nogil=True)
def _pread_kernel(descriptor, slots, record_bytes, out):  # pragma: no cover - numba
    """Read record ``slots[i]`` into ``out[i]`` for ascending `slots`, one ``pread`` per run of
    adjacent slots; returns the number of records read (less on a failed or short read)."""
    count = slots.shape[0]
    base = out.ctypes.data
    start = 0
    while start < count:
        end = start + 1
        while end < count and slots[end] == slots[end - 1] + 1:
            end += 1
        length = (end - start) * record_bytes
        done = _PREAD(descriptor, base + start * record_bytes, length, slots[start] * record_bytes)
        if done != length:
            return start
        start = end
    return count


@numba.njit(nogil=True)
def _pwrite_kernel(descriptor, slots, record_bytes, records):  # pragma: no cover - numba
    """Write ``records[i]`` to record ``slots[i]`` for ascending `slots`, one ``pwrite`` per run of
    adjacent slots; returns the number of records written (less on a failed or short write)."""
    count = slots.shape[0]
    base = records.ctypes.data
    start = 0
    while start < count:
        end = start + 1
        while end < count and slots[end] == slots[end - 1] + 1:
            end += 1
        length = (end - start) * record_bytes
        done = _PWRITE(descriptor, base + start * record_bytes, length, slots[start] * record_bytes)
        if done != length:
            return start
        start = end
    return count


@numba.njit(nogil=True)
def _read_ahead_kernel(descriptor, slots, record_bytes, records, checksum_word, corrupt):  # pragma: no cover
    """`_pread_kernel`, then mark each record read whose checksum (word `checksum_word`) does not
    match its first `checksum_word` words: all of a prefetch's work, without the GIL."""
    done = _pread_kernel(descriptor, slots, record_bytes, records)
    words = records.view(np.uint64)
    for i in range(done):
        digest = np.uint64(0)
        for j in range(checksum_word):
            digest += mix64(words[i, j] ^ (np.uint64(j + 1) * np.uint64(GOLDEN_GAMMA)))
        corrupt[i] = mix64(digest ^ np.uint64(CHECKSUM_SEED)) != words[i, checksum_word]
    return done


@numba.njit(cache=True, nogil=True)
def _checksum_kernel(words, out):  # pragma: no cover - numba
    """One 64-bit checksum per record: (records, words) uint64 -> (records,) uint64. The terms are
    independent (word j mixed with its position), so the loop vectorises."""
    for i in range(words.shape[0]):
        digest = np.uint64(0)
        for j in range(words.shape[1]):
            digest += mix64(words[i, j] ^ (np.uint64(j + 1) * np.uint64(GOLDEN_GAMMA)))
        out[i] = mix64(digest ^ np.uint64(CHECKSUM_SEED))


@dataclass(frozen=True)
class RecordField:
    name: str  # "rows", "row_scale", "row_offset", "optimizer_state/<name>", "counts", "last_step", "ids"
    dtype: np.dtype
    width: int  # values per row (dim, or 1)
    offset: int  # byte offset in the record

    @property
    def nbytes(self) -> int:
        return self.width * self.dtype.itemsize


class RecordLayout:
    """Byte layout of one row's record for a (dim, precision, optimizer); a multiple of 8 bytes, the
    id and then the checksum last."""

    def __init__(self, dim: int, *, precision: str, optimizer: str) -> None:
        specs: list[tuple[str, np.dtype, int]] = [("rows", np.dtype(PAYLOAD_DTYPES[precision]), dim)]
        if precision == "int8":
            specs += [("row_scale", np.dtype(np.float32), 1), ("row_offset", np.dtype(np.float32), 1)]
        for name, kind, state_dtype in STATE_LAYOUT[optimizer]:
            width = dim if kind == "element" else 1
            specs.append((f"optimizer_state/{name}", np.dtype(state_dtype), width))
        specs += [("counts", np.dtype(np.uint32), 1), ("last_step", np.dtype(np.uint32), 1)]
        specs.append(("ids", np.dtype(np.int64), 1))
        fields, offset = [], 0
        for name, dtype, width in specs:
            fields.append(RecordField(name, dtype, width, offset))
            offset += width * dtype.itemsize
        self.fields = fields
        self.checksum_offset = (offset + 7) // 8 * 8
        self.record_bytes = self.checksum_offset + 8
        self.dim = dim
        self.id_offset = next(field.offset for field in fields if field.name == "ids")

    def ids(self, records: np.ndarray) -> np.ndarray:
        """(n,) int64 ids stored in (n, record_bytes) records."""
        return np.ascontiguousarray(records[:, self.id_offset : self.id_offset + 8]).view(np.int64)[:, 0]

    def pack(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """(n, record_bytes) uint8 records of `values` (name -> (n,) or (n, width) arrays), checksummed."""
        count = values["counts"].shape[0]
        records = np.zeros((count, self.record_bytes), dtype=np.uint8)
        for field in self.fields:
            array = np.ascontiguousarray(values[field.name], dtype=field.dtype).reshape(count, field.width)
            records[:, field.offset : field.offset + field.nbytes] = array.view(np.uint8)
        words = records[:, : self.checksum_offset].view(np.uint64)
        records[:, self.checksum_offset :].view(np.uint64)[:, 0] = self.checksums(words)
        return records

    def checksums(self, words: np.ndarray) -> np.ndarray:
        out = np.empty(words.shape[0], dtype=np.uint64)
        _checksum_kernel(np.ascontiguousarray(words), out)
        return out

    def unpack(self, records: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of (n, record_bytes) records: per-row arrays, (n,) for width 1."""
        count = records.shape[0]
        out = {}
        for field in self.fields:
            raw = np.ascontiguousarray(records[:, field.offset : field.offset + field.nbytes])
            array = raw.view(field.dtype).reshape(count, field.width)
            out[field.name] = array[:, 0].copy() if field.width == 1 and field.name != "rows" else array
        return out

    def corrupt(self, records: np.ndarray) -> np.ndarray:
        """Mask of records whose stored checksum does not match their contents."""
        words = np.ascontiguousarray(records[:, : self.checksum_offset]).view(np.uint64)
        stored = np.ascontiguousarray(records[:, self.checksum_offset :]).view(np.uint64)[:, 0]
        return self.checksums(words) != stored


class DiskTierError(OSError):
    """The disk tier's directory cannot hold its file (missing, not writable, full)."""


def check_disk_dir(directory: str | os.PathLike[str], *, table: str, needed_bytes: int = 0) -> Path:
    """`directory` as a Path once it exists, is a writable directory and has `needed_bytes` free;
    otherwise a `DiskTierError` naming the directory and what to do."""
    path = Path(directory).expanduser()
    where = f"table {table!r}: storage.disk_dir {str(path)!r}"
    if not path.exists():
        raise DiskTierError(f"{where} does not exist: create it or point disk_dir at a local directory")
    if not path.is_dir():
        raise DiskTierError(f"{where} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(b"psrec")
    except OSError as error:
        raise DiskTierError(
            f"{where} is not writable ({error.strerror}): choose a directory this process may write"
        ) from None
    stats = os.statvfs(path)
    free = stats.f_bavail * stats.f_frsize
    if needed_bytes > free:
        raise DiskTierError(
            f"{where} has {free / 2**30:.2f} GiB free, the disk tier needs {needed_bytes / 2**30:.2f} GiB: "
            "free space there, choose another disk_dir or raise the memory budget"
        )
    return path


_READER: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): one reader thread a process
_READER_LOCK = threading.Lock()


def _reader() -> ThreadPoolExecutor:
    """The process's prefetch thread, shared by all its tables (their reads queue up in order); a
    forked child makes its own (the parent's thread does not exist there)."""
    global _READER
    with _READER_LOCK:
        if _READER is None or _READER[0] != os.getpid():
            _READER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="psrec-disk-tier"))
        return _READER[1]


@dataclass
class _Prefetch:
    """Records being read on the background thread: ascending `slots`, their segments' generations
    when the read was issued, and the future of (records read, corrupt mask)."""

    slots: np.ndarray
    generations: np.ndarray
    records: np.ndarray
    future: Future[tuple[int, np.ndarray]]


class DiskTier:
    """Cold rows of one table partition: ids -> records in an unlinked slab file (module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        layout: RecordLayout,
        *,
        table: str,
        segment_rows: int = SEGMENT_ROWS,
    ) -> None:
        self.directory = check_disk_dir(directory, table=table)
        self.layout = layout
        self.table = table
        self.segment_rows = int(segment_rows)
        # unlinked at once; held open for the tier's life, closed by close()
        self._file = tempfile.TemporaryFile(dir=self.directory, prefix=f"psrec-{table}-")  # noqa: SIM115
        self._prefetch: _Prefetch | None = None
        self._reset()
        self.bytes_read = 0
        self.bytes_written = 0
        self.relocations = 0  # live records appended again by segment cleaning
        self.prefetch_hits = 0  # records a read took from a prefetch

    def _reset(self) -> None:
        self._index = HashIndex()
        self._metadata = np.zeros((0, 2), dtype=np.uint32)  # per entry: [count, last step]
        self._slots = np.zeros(0, dtype=np.int32)  # per entry: slot of the current copy, -1 resident
        self._resident_count = 0
        self._log = SegmentLog(self.segment_rows)

    # ------------------------------------------------------------------------------------ sizes
    @property
    def num_rows(self) -> int:
        """Rows whose current copy is on disk."""
        return self._index.num_rows - self._resident_count

    def memory_bytes(self) -> int:
        """Bytes the tier keeps in memory: its index and per-row metadata."""
        log = self._log
        return (
            self._index.nbytes()
            + int(self._metadata.nbytes + self._slots.nbytes)
            + int(log.live.nbytes + log.generation.nbytes)
        )

    def disk_bytes(self) -> int:
        return self._log.capacity * self.layout.record_bytes

    # ------------------------------------------------------------------------------------ file
    def _grow(self) -> None:
        """Add empty segments: a quarter more of the file, at least one segment."""
        log = self._log
        segments = max(1, int(np.ceil(log.num_segments * (SLAB_GROWTH - 1))))
        if (log.num_segments + segments) * log.segment_rows > MAX_SLOTS:
            raise DiskTierError(
                f"table {self.table!r}: the disk tier in {str(self.directory)!r} would pass {MAX_SLOTS} "
                "records: split the table over more shards or raise the memory budget"
            )
        size = (log.num_segments + segments) * log.segment_rows * self.layout.record_bytes
        try:
            os.posix_fallocate(self._file.fileno(), 0, size)
        except OSError as error:
            raise DiskTierError(
                f"table {self.table!r}: the disk tier in {str(self.directory)!r} cannot grow to "
                f"{size / 2**30:.2f} GiB ({error.strerror}): free space there, choose another "
                "storage.disk_dir or raise the memory budget"
            ) from None
        log.add_segments(segments)

    def _io_error(self, action: str, slot: int, error: OSError) -> DiskTierError:
        return DiskTierError(
            f"table {self.table!r}: cannot {action} record {slot} of the disk tier in "
            f"{str(self.directory)!r} ({error.strerror or error}): check the disk, then restore the shard "
            "from its last checkpoint"
        )

    def _pread(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Records of ascending `slots` into `out` (a kernel call; the rest in Python after a failure,
        so an error carries its errno)."""
        record_bytes = self.layout.record_bytes
        descriptor = self._file.fileno()
        done = int(_pread_kernel(descriptor, slots, record_bytes, out))
        for position in range(done, slots.shape[0]):  # only after an interrupted or failed call
            offset = int(slots[position]) * record_bytes
            try:
                data = os.pread(descriptor, record_bytes, offset)
            except OSError as error:
                raise self._io_error("read", int(slots[position]), error) from None
            if len(data) != record_bytes:
                raise self._io_error("read", int(slots[position]), OSError("short read past the end"))
            out[position] = np.frombuffer(data, dtype=np.uint8)

    def _pwrite(self, slots: np.ndarray, records: np.ndarray) -> None:
        record_bytes = self.layout.record_bytes
        descriptor = self._file.fileno()
        done = int(_pwrite_kernel(descriptor, slots, record_bytes, records))
        for position in range(done, slots.shape[0]):
            view = memoryview(records[position])
            offset = int(slots[position]) * record_bytes
            try:
                while view.nbytes:  # a short write continues where it stopped
                    written = os.pwrite(descriptor, view, offset)
                    view, offset = view[written:], offset + written
            except OSError as error:
                raise self._io_error("write", int(slots[position]), error) from None

    def close(self) -> None:
        self._drop_prefetch()
        self._file.close()

    # ------------------------------------------------------------------------------------ log
    def _append(self, entries: np.ndarray, records: np.ndarray) -> None:
        """Write `records` at the log's head and make them the current copies of `entries`."""
        pending = [(entries, records)]
        while pending:
            entries, records = pending.pop()
            position = 0
            while position < entries.shape[0]:
                run = self._log.next_run(entries.shape[0] - position)
                if run is None:
                    self._make_room(pending)
                    continue
                first, count = run
                slots = np.arange(first, first + count, dtype=np.int64)
                self._pwrite(slots, records[position : position + count])
                self._slots[entries[position : position + count]] = slots
                position += count
            self.bytes_written += int(records.nbytes)

    def _make_room(self, pending: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Free a segment for the head: clean the emptiest sealed one (its live records join
        `pending`), or grow the file when every sealed segment is mostly live."""
        segment = self._log.cleaning_candidate()
        if segment is None:
            self._grow()
            return
        slots = self._log.slots_of(segment)
        records = np.empty((slots.shape[0], self.layout.record_bytes), dtype=np.uint8)
        self._pread(slots, records)
        self.bytes_read += int(records.nbytes)
        entries, _ = self._index.lookup(self.layout.ids(records))
        live = entries >= 0
        live[live] = self._slots[entries[live]] == slots[live]
        self._log.release(slots[live])  # the segment is empty now, the head's next
        if live.any():
            pending.append((entries[live], records[live]))
            self.relocations += int(live.sum())

    # ------------------------------------------------------------------------------------ rows
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id whose current copy is on disk, -1 for the others."""
        entries, missing = self._index.lookup(ids)
        slots = np.full(ids.shape[0], -1, dtype=np.int64)
        if missing < ids.shape[0]:
            found = np.flatnonzero(entries >= 0)
            slots[found] = self._slots[entries[found]]
        return slots

    def live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, counts, last_step) of every row on disk, in slot order."""
        entries = self._index.live_rows(sort=False)
        entries = entries[self._slots[entries] >= 0]
        entries = entries[np.argsort(self._slots[entries], kind="stable")]
        return self._index.keys[entries], self._metadata[entries, 0], self._metadata[entries, 1]

    def write(self, values: dict[str, np.ndarray]) -> None:
        """Store whole rows: `values["ids"]` (unique; new, or resident: promoted earlier) and their
        fields."""
        ids = values["ids"]
        if ids.shape[0] == 0:
            return
        entries, inserted = self._index.insert(ids)
        capacity = self._index.row_capacity
        self._metadata = grow_rows(self._metadata, capacity)
        self._slots = grow_rows(self._slots, capacity)
        self._slots[entries[inserted]] = -1
        rewritten = entries[~inserted]
        if rewritten.shape[0]:
            if (self._slots[rewritten] >= 0).any():
                raise RuntimeError(f"table {self.table!r}: ids written to the disk tier twice")
            self._resident_count -= int(rewritten.shape[0])
        for start in range(0, ids.shape[0], CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            self._append(
                entries[chunk], self.layout.pack({name: array[chunk] for name, array in values.items()})
            )
        self._metadata[entries, 0] = values["counts"]
        self._metadata[entries, 1] = values["last_step"]

    def read(self, slots: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The rows of `ids` from their `slots` (all >= 0), checksums and ids verified; records still
        valid in the prefetch are taken from it."""
        order = np.argsort(slots, kind="stable")
        records = np.empty((slots.shape[0], self.layout.record_bytes), dtype=np.uint8)
        needed = self._take_prefetched(slots, records)
        order = order[needed[order]]
        for start in range(0, order.shape[0], CHUNK_ROWS):
            chunk = order[start : start + CHUNK_ROWS]
            buffer = np.empty((chunk.shape[0], self.layout.record_bytes), dtype=np.uint8)
            self._pread(slots[chunk].astype(np.int64), buffer)
            records[chunk] = buffer
        self.bytes_read += int(order.shape[0]) * self.layout.record_bytes
        bad = self.layout.ids(records) != ids  # prefetched records passed their checksum already
        bad[needed] |= self.layout.corrupt(records[needed])
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise RuntimeError(
                f"table {self.table!r}: {int(bad.sum())} corrupt record(s) in the disk tier under "
                f"{str(self.directory)!r} (first: id {int(ids[first])}); restore the shard from its last "
                "checkpoint"
            )
        return self.layout.unpack(records)

    def take(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Read the rows of the unique `ids` that are on disk and mark them resident (promotion); ends
        the prefetch."""
        entries, _ = self._index.lookup(ids)
        slots = np.full(ids.shape[0], -1, dtype=np.int64)
        found = entries >= 0
        slots[found] = self._slots[entries[found]]
        on_disk = slots >= 0
        entries, slots = entries[on_disk], slots[on_disk]
        values = self.read(slots, ids[on_disk])
        self._drop_prefetch()
        self._log.release(slots)
        self._slots[entries] = -1
        self._resident_count += int(slots.shape[0])
        return values

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Forget the ids (resident or not); returns those whose current copy was on disk."""
        if self._index.num_rows == 0 or ids.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        entries, _ = self._index.lookup(ids)
        found = entries >= 0
        slots = np.full(ids.shape[0], -1, dtype=np.int64)
        slots[found] = self._slots[entries[found]]
        on_disk = slots >= 0
        self._log.release(slots[on_disk])
        self._resident_count -= int(np.count_nonzero(found & ~on_disk))
        self._index.remove(ids)
        return ids[on_disk]

    def clear(self) -> None:
        self._drop_prefetch()
        self._reset()
        self._file.truncate(0)

    # ------------------------------------------------------------------------------------ prefetch
    def prefetch(self, ids: np.ndarray) -> int:
        """Start reading, on a background thread, the records of those `ids` (unique) whose current
        copy is on disk; returns how many. Replaces an earlier prefetch."""
        self._drop_prefetch()
        slots = self.lookup(ids)
        slots = np.sort(slots[slots >= 0])
        if slots.shape[0] == 0:
            return 0
        records = np.empty((slots.shape[0], self.layout.record_bytes), dtype=np.uint8)
        generations = self._log.generation[slots // self._log.segment_rows]
        future = _reader().submit(self._read_ahead, self._file.fileno(), slots, records)
        self._prefetch = _Prefetch(slots, generations, records, future)
        self.bytes_read += int(records.nbytes)
        return int(slots.shape[0])

    def _read_ahead(self, descriptor: int, slots: np.ndarray, records: np.ndarray) -> tuple[int, np.ndarray]:
        """The background read: records read (a prefix; the rest are read again on demand) and which
        of them fail their checksum (torn by a reuse of their segment, or damaged)."""
        corrupt = np.zeros(slots.shape[0], dtype=np.bool_)
        layout = self.layout
        done = int(
            _read_ahead_kernel(
                descriptor, slots, layout.record_bytes, records, layout.checksum_offset // 8, corrupt
            )
        )
        return done, corrupt[:done]

    def _take_prefetched(self, slots: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Copy into `records` the prefetched records of `slots` that are still current; returns the
        mask of slots still to read."""
        needed = np.ones(slots.shape[0], dtype=np.bool_)
        prefetch = self._prefetch
        if prefetch is None or slots.shape[0] == 0:
            return needed
        done, corrupt = prefetch.future.result()
        current = np.zeros(prefetch.slots.shape[0], dtype=np.bool_)
        current[:done] = ~corrupt & (
            self._log.generation[prefetch.slots[:done] // self._log.segment_rows]
            == prefetch.generations[:done]
        )
        positions = np.minimum(np.searchsorted(prefetch.slots, slots), prefetch.slots.shape[0] - 1)
        hit = (prefetch.slots[positions] == slots) & current[positions]
        records[hit] = prefetch.records[positions[hit]]
        self.prefetch_hits += int(hit.sum())
        return ~hit

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.future.result()  # the thread must be done with the file and the buffer
            self._prefetch = None
