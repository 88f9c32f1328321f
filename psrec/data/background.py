"""`BackgroundIterator`: run an iterator on a thread, a bounded number of items ahead of its consumer.

The reader's prefetch (`psrec.data.reader`) and the trainer's planner (`psrec.train.step`) both hand
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
slow down: a producer waits at the gate before each item (an item already begun runs to its end).
The in-process trainer holds its reader and planner threads back while it pulls and pushes rows and
while its dense optimizer steps: that work is Python plus numba (or many small torch ops) on the
training thread, and the pull took 3.2-4.1 ms instead of 1.8-2.2 ms per step when the input threads
ran beside it (GIL and both cores shared). The input threads then work during forward and backward,
in long torch ops that release the GIL; see docs/benchmarks-history.md (fifth session).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()
_POLL_SECONDS = 0.05  # how often a producer blocked on a full queue checks for `close`


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
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(error))
            return
        self._put(_END)

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
