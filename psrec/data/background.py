"""`BackgroundIterator`: run an iterator on a thread, a bounded number of items ahead of its consumer.

The reader's prefetch (`psrec.data.reader`) and the trainer's planner (in `StepRunner`) both hand
work to a thread this way::

    items = BackgroundIterator(lambda: produce(), depth=2, name="psrec-prefetch")
    try:
        for item in items:      # in order; the source's exception is re-raised here, with its type
            use(item)
    finally:
        items.close()           # stops the thread and waits for it

The source runs on the thread only, and `close` returns after the thread has stopped, so the
source (a file reader, a generator) is never used by two threads at once.

An `InputGate` lets the consumer hold producers back while it runs work of its own that they would
slow down. A producer waits at the gate before each item, and at the `checkpoint()`s its source
passes within an item (the Parquet reader has one between column groups of a row group and one
before preparing them). Otherwise an item already begun runs to its end.

The in-process trainer holds its reader and planner threads back for its whole training step, and
lets them run only while it waits for its next batch (`InputGate.released()` around that wait, when
no batch is ready). On two shared cores, every input thread that ran beside the step slowed it by
more than its own work: the pull took 3.2-4.1 instead of 1.8-2.2 ms (GIL and cores shared), and
forward, backward and the optimizer lost their cores to the reader's decode. In same-process A/B
runs on the bench's DLRM, holding the input only during pull, push and the optimizer gained 2-4%;
holding it for the whole step gains another 5.6-7.8% in eager bf16 and 9.3% compiled: input work
then runs only while the trainer would wait anyway, on both cores (docs/benchmarks.md lists the
variants tried and rejected).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from psrec.threads import apply_thread_counts

T = TypeVar("T")

_END = object()
_POLL_SECONDS = 0.05  # how often a producer blocked on a full queue checks for `close`
_PRODUCER = threading.local()  # .iterator: the BackgroundIterator whose thread this is


class _Closed(BaseException):  # not an error: no `except Exception` in a source may stop it
    """Raised in a producer's thread by `checkpoint()` when its iterator was closed meanwhile."""


def checkpoint() -> None:
    """A point inside a producer's item where it may pause: waits while the producer's gate is held.

    A no-op outside a gated `BackgroundIterator` thread. When the iterator is closed meanwhile, the
    item ends here (the producer thread stops; nothing reaches the consumer)."""
    iterator = getattr(_PRODUCER, "iterator", None)
    if iterator is not None and not iterator._through_gate():
        raise _Closed


def gated() -> bool:
    """True in the thread of a `BackgroundIterator` that has a gate (its `checkpoint()`s may wait)."""
    iterator = getattr(_PRODUCER, "iterator", None)
    return iterator is not None and iterator._gate is not None


class InputGate:
    """Open unless some thread holds it (`with gate.held(): ...`, nestable); producers wait at it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._holds = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._holds += 1
            self._open.clear()
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0:
                    self._open.set()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Inside `held()`: give up that hold for the block (e.g. while waiting for the producers)."""
        with self._lock:
            if self._holds <= 0:
                raise RuntimeError("InputGate.released() needs a hold (inside held())")
            self._holds -= 1
            if self._holds == 0:
                self._open.set()
        try:
            yield
        finally:
            with self._lock:
                self._holds += 1
                self._open.clear()

    def wait(self, timeout: float) -> bool:
        """True once the gate is open, False if it stayed closed for `timeout` seconds."""
        return self._open.wait(timeout)


@dataclass
class _Failure:
    error: BaseException


class BackgroundIterator(Generic[T]):
    """Items of `source()` produced on a daemon thread, up to `depth` ahead (see the module docstring)."""

    def __init__(
        self, source: Callable[[], Iterator[T]], *, depth: int, name: str, gate: InputGate | None = None
    ) -> None:
        if depth < 1:
            raise ValueError(f"BackgroundIterator depth must be >= 1, got {depth}")
        self._source = source
        self._gate = gate
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _through_gate(self) -> bool:
        """Wait for the gate to be open; False if `close` came first."""
        if self._gate is not None:
            while not self._gate.wait(_POLL_SECONDS):
                if self._stop.is_set():
                    return False
        return not self._stop.is_set()

    def _run(self) -> None:
        _PRODUCER.iterator = self
        apply_thread_counts()  # the process's torch/numba counts hold per thread (psrec.threads)
        try:
            items = self._source()
            while True:
                if not self._through_gate():
                    return  # closed while waiting at the gate
                item = next(items, _END)
                if item is _END:
                    break
                if self._stop.is_set() or not self._put(item):
                    return
        except _Closed:
            return  # closed while waiting at a checkpoint within an item
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(error))
            return
        self._put(_END)

    def ready(self) -> bool:
        """True when an item (or the end) is waiting in the queue: `next` returns without waiting."""
        return not self._queue.empty()

    def __iter__(self) -> BackgroundIterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # closed before its end
                    self._done = True
                    raise StopIteration from None
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread and wait for it (safe to call twice)."""
        self._stop.set()
        self._done = True
        self._thread.join()
