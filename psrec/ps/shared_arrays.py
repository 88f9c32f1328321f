"""Arrays between a trainer and the shard actors on its machine through shared memory.

A Ray actor call puts every argument and reply over 100 KB into Ray's object store: a copy into a
fresh object, the raylet's bookkeeping, and page faults on the store's new pages, on the trainer's
critical path (`docs/benchmarks.md`, "psrec on Ray against in-process"). Between a trainer and a
shard on the same machine the bulk of a step (the pushed ids and gradients, the pulled ids and the
rows coming back) goes instead through POSIX shared-memory segments (``/dev/shm``) that the
trainer's connection owns and reuses; the actor call carries only their names and layout.

- The trainer writes a message's arrays into a free segment of its `SegmentPool` (`SharedArrays`
  names them) and sends the call; the segment is the call's until the call is answered, so a call
  sent again to a restarted shard finds the same bytes.
- The shard reads a message in place only where it keeps nothing of it once it has answered: a push
  it applies as it arrives (async, or one trainer), the ids of a pull when it keeps no replies (no
  log). Otherwise it copies them out first (`SharedArrays.load`): a sync shard of several trainers
  holds pushes until every trainer's has come; a logged shard keeps its replies' ids and rows.
- The shard writes the rows it answers into a reply segment the trainer reserved (`ReplySpace`),
  gathering them there directly when it keeps no copy and sends float32; the trainer reads them in
  place. A reply segment is reused only once the call is answered and no
  array the trainer holds still views it (CPython's reference count of the segment's buffer, as
  `psrec.allocator.ReusableBuffers` does for its arrays).
- A shard that cannot open a segment (it runs on another machine, e.g. restarted elsewhere) raises
  `SharedMemoryUnavailable` before it changes anything; the connection then sends the call again
  with the arrays themselves, and from then on sends everything through Ray.
- Segments are unlinked when their pool is closed or garbage-collected; their names start with the
  Ray job's (`job_prefix`), and the driver unlinks what a killed trainer left on its machine
  (`unlink_job_segments`).

    pool = SegmentPool()
    message = pool.write({"ids": ids})          # in the trainer; send `message.arrays` in the call
    arrays = message.arrays.load()              # in the shard: copies
    pool.release(message)                       # once the call is answered
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

SHM_DIRECTORY = "/dev/shm"
# Bytes rounded up to this; each array starts on a 64-byte boundary.
_GRANULE = 1 << 20
_ALIGN = 64
# A new segment is created only while /dev/shm keeps this share free (a tmpfs that runs out while a
# segment's pages are first written kills the writer with SIGBUS).
_FREE_SHARE = 0.5
# Segments a shard keeps open (the newest); older ones are closed.
_ATTACHED_KEPT = 64


class SharedMemoryUnavailable(RuntimeError):
    """A shard could not open a trainer's segment (it runs on another machine)."""


Layout = dict[str, tuple[int, tuple[int, ...], str]]  # key -> (offset, shape, dtype)


@dataclass(frozen=True)
class SharedArrays:
    """Named arrays in a shared-memory segment: what an actor call carries instead of them."""

    segment: str
    layout: Layout

    def load(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Copies of the arrays; with ``copy=False`` views, which the caller must not keep once it has
        answered the call (the trainer reuses the segment then). Views stay writeable: numba compiles
        read-only arrays as another type."""
        buffer = _buffer(_attached(self.segment))
        views = {key: _view(buffer, place) for key, place in self.layout.items()}
        return {key: view.copy() for key, view in views.items()} if copy else views


@dataclass(frozen=True)
class ReplySpace:
    """A segment the trainer reserved for a shard's reply, and its size in bytes."""

    segment: str
    capacity: int

    def write(self, arrays: dict[str, np.ndarray]) -> SharedArrays | None:
        """Write `arrays` into the segment; None when they do not fit (then they go through Ray)."""
        placed = self.place(_shapes(arrays))
        if placed is None:
            return None
        shared, views = placed
        for key, array in arrays.items():
            views[key][...] = array
        return shared

    def place(
        self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]
    ) -> tuple[SharedArrays, dict[str, np.ndarray]] | None:
        """Arrays of these shapes and dtypes in the segment, for the shard to fill, and what the reply
        carries to name them; None when they do not fit."""
        layout, size = _layout(shapes)
        if size > self.capacity:
            return None
        buffer = _buffer(_attached(self.segment))
        return SharedArrays(self.segment, layout), {
            key: _view(buffer, place) for key, place in layout.items()
        }


@dataclass
class Message:
    """A segment a call uses, held until the call is answered (`SegmentPool.release`)."""

    segment: _Segment
    arrays: SharedArrays | None = None
    reply: ReplySpace | None = None


class _Segment:
    def __init__(self, memory: shared_memory.SharedMemory) -> None:
        self.memory = memory
        self.buffer: memoryview = memory.buf  # type: ignore[assignment]  # None only once closed
        self.size = memory.size
        self.in_use = False
        # An array made on the segment's buffer holds a reference to the mapping that exports it.
        self._owner = self.buffer.obj
        self._references = sys.getrefcount(self._owner)

    def free(self) -> bool:
        """Not used by a call, and no array the trainer holds views it."""
        return not self.in_use and sys.getrefcount(self._owner) <= self._references


class SegmentPool:
    """The trainer side: segments created on demand and reused, unlinked on `close`."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or job_prefix("nojob") + uuid.uuid4().hex[:12]
        self._segments: list[_Segment] = []
        self._count = 0
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)

    def write(self, arrays: dict[str, np.ndarray]) -> Message | None:
        """A segment holding `arrays`, or None when /dev/shm has no room for a new one."""
        layout, nbytes = _layout(_shapes(arrays))
        segment = self._take(nbytes)
        if segment is None:
            return None
        _write(segment.buffer, arrays, layout)
        return Message(segment, arrays=SharedArrays(segment.memory.name, layout))

    def reserve(self, nbytes: int) -> Message | None:
        """A segment of at least `nbytes` for a reply, or None."""
        segment = self._take(nbytes)
        if segment is None:
            return None
        return Message(segment, reply=ReplySpace(segment.memory.name, segment.size))

    def release(self, message: Message) -> None:
        """The call that used `message` is answered: its segment may be reused (once no array views it)."""
        message.segment.in_use = False

    def read(self, message: Message, arrays: SharedArrays) -> dict[str, np.ndarray]:
        """Views of a reply the shard wrote into `message`'s segment (no copy)."""
        return {key: _view(message.segment.buffer, place) for key, place in arrays.layout.items()}

    def close(self) -> None:
        self._finalizer()

    @property
    def segment_names(self) -> list[str]:
        return [segment.memory.name for segment in self._segments]

    def _take(self, nbytes: int) -> _Segment | None:
        fitting = [s for s in self._segments if s.size >= nbytes and s.free()]
        if fitting:
            segment = min(fitting, key=lambda s: s.size)
        else:
            size = -(-max(nbytes, 1) * 5 // 4 // _GRANULE) * _GRANULE
            if not _room_for(size):
                return None
            self._count += 1
            try:
                memory = shared_memory.SharedMemory(f"{self.prefix}-{self._count}", create=True, size=size)
            except OSError:
                return None
            segment = _Segment(memory)
            self._segments.append(segment)
            _CREATED.add(memory.name)
        segment.in_use = True
        return segment


def job_prefix(job: str) -> str:
    """The start of every segment name of a Ray job's trainers (`unlink_job_segments`)."""
    return f"psrec-{job}-"


def unlink_job_segments(job: str) -> int:
    """Unlink what is left in this machine's /dev/shm of a job's segments (a trainer killed before
    it closed its connections); returns how many."""
    removed = 0
    directory = Path(SHM_DIRECTORY)
    if not directory.is_dir():
        return 0
    for path in directory.glob(job_prefix(job) + "*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def _room_for(size: int) -> bool:
    try:
        stats = os.statvfs(SHM_DIRECTORY)
    except OSError:
        return False
    return size <= stats.f_bavail * stats.f_frsize * _FREE_SHARE


def _unlink_all(segments: list[_Segment]) -> None:
    for segment in segments:
        _CREATED.discard(segment.memory.name)
        with contextlib.suppress(BufferError):  # an array still views it: the mapping goes with the process
            segment.memory.close()
        with contextlib.suppress(FileNotFoundError):
            segment.memory.unlink()
    segments.clear()


def _shapes(arrays: dict[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {key: (array.shape, array.dtype) for key, array in arrays.items()}


def _layout(shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[Layout, int]:
    """Where each array goes (each on a 64-byte boundary) and the bytes they take. Plain Python
    arithmetic: a push lays out two arrays per table on every step."""
    layout: Layout = {}
    offset = 0
    for key, (shape, dtype) in shapes.items():
        dtype = np.dtype(dtype)
        layout[key] = (offset, tuple(shape), dtype.str)
        offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return layout, offset


def _write(buffer: memoryview, arrays: dict[str, np.ndarray], layout: Layout) -> None:
    for key, array in arrays.items():
        _view(buffer, layout[key])[...] = array


def _view(buffer: memoryview, place: tuple[int, tuple[int, ...], str]) -> np.ndarray:
    offset, shape, dtype = place
    return np.ndarray(shape, np.dtype(dtype), buffer=buffer, offset=offset)


def _buffer(memory: shared_memory.SharedMemory) -> memoryview:
    buffer = memory.buf
    assert buffer is not None  # None only once closed
    return buffer


# Segments made by this process's pools (their owner: the resource tracker unlinks them if it dies).
_CREATED: set[str] = set()
# The shard side: segments opened by name, the newest kept open.
_ATTACHED: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()


def _attached(name: str) -> shared_memory.SharedMemory:
    memory = _ATTACHED.get(name)
    if memory is not None:
        _ATTACHED.move_to_end(name)
        return memory
    try:
        memory = shared_memory.SharedMemory(name)
    except FileNotFoundError:
        raise SharedMemoryUnavailable(f"shared-memory segment {name} is not on this machine") from None
    # Opening registers the segment with this process's resource tracker, which would unlink it when
    # this process exits: the process that made it owns it.
    if name not in _CREATED:
        resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
    _ATTACHED[name] = memory
    while len(_ATTACHED) > _ATTACHED_KEPT:
        _, oldest = _ATTACHED.popitem(last=False)
        with contextlib.suppress(BufferError):
            oldest.close()
    return memory
