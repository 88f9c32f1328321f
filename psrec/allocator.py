"""glibc malloc settings for training processes: `tune_malloc`.

A training step allocates and frees the same large buffers every step (activations, gradients,
pulled rows). With glibc's defaults, blocks above the mmap threshold are mapped and unmapped each
time and the heap top is trimmed back to the system, so every step page-faults its buffers in again;
on the virtualised 2-core machine of docs/benchmarks.md that cost the dense-only DLRM ceiling 1.46x
in samples/s (`psrec bench --systems psrec-bf16,ceiling-bf16 --no-isolate --steps 20` under
`/usr/bin/time`: 1.06M minor faults with glibc's defaults, 0.38M with these settings).
PyTorch's CPU performance guides recommend the same remedy (jemalloc/tcmalloc, or these glibc
knobs): keep freed memory in the process for reuse. `tune_malloc` sets

- ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's dynamic maximum, fixed from the start), and
- ``M_TRIM_THRESHOLD`` to 1 GiB (free memory at the heap top is kept up to that much),

in this process (``mallopt``) and exports them as ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` for the processes it starts (bench systems, Ray workers). Memory freed
after a peak then stays mapped (up to 1 GiB per arena) instead of going back to the system.
Set ``PSREC_MALLOC_TUNING=0`` to keep glibc's defaults; MALLOC_* variables set by the user win.

`release_free_memory` gives memory held free back to the system at a change of phase, such as
evaluation after training: the arrays that `ReusableBuffers` pools keep for the next step and nothing
uses (every pool, busy arrays untouched), then malloc's free memory (``malloc_trim``, every arena).
Evaluation's batches (16384 rows against training's 4096) need blocks and buffers of other sizes,
which training's freed ones do not fit, so without a release the evaluation's memory comes on top of
them. After each evaluation batch malloc's free memory alone goes back (``pools=False``: the next
batch reuses the pooled buffers), or each batch's freed blocks add to the next one's. Figures:
docs/benchmarks.md, "Memory".

`advise_huge_pages` asks Linux for transparent huge pages (2 MiB) under a large array, e.g. an
embedding table's rows. Lookups hit rows at random across hundreds of MiB: with 4 KiB pages nearly
each one also misses the TLB. Where THP is in ``madvise`` mode (as on the machine of
docs/benchmarks.md), only advised memory gets huge pages; in ``always`` mode the call changes nothing
and in ``never`` mode it has no effect. Set ``PSREC_HUGE_PAGES=0`` to skip it.

`ReusableBuffers` hands out a step's large scratch arrays (the pulled rows, the pooling gradient)
from arrays of earlier steps that nothing refers to any more: glibc maps a fresh block above its 32
MiB threshold for every such array, and the kernel zeroes each page at its first write
(`clear_page_erms` was 27% of the CPU samples of a 50-id multi-hot bench run).

`populate` backs an array's pages with memory now instead of at their first write. A table that
reserves rows up front (``expected_rows``) populates them when it is built: otherwise each step that
inserts rows past a page boundary takes the page fault. On the bench's virtual machine a first
touch of a 2 MiB huge page cost 4.5-5 ms (the hypervisor backs guest memory on first use), about
1 ms per step in the first epoch (docs/benchmarks.md, "What the fast path does"). It uses
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) and falls back to writing every page.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
import time
import weakref

import numpy as np

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
SETTINGS = {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TRIM_THRESHOLD_": 1 << 30}
_PARAMETERS = {"MALLOC_MMAP_THRESHOLD_": _M_MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": _M_TRIM_THRESHOLD}


def malloc_environment() -> dict[str, str]:
    """The MALLOC_* variables child processes should get ({} when tuning is off or not glibc)."""
    if os.environ.get("PSREC_MALLOC_TUNING", "1") == "0" or _libc() is None:
        return {}
    return {name: os.environ.get(name, str(value)) for name, value in SETTINGS.items()}


def tune_malloc() -> bool:
    """Apply the settings to this process and export them; False when off, user-set or not glibc."""
    libc = _libc()
    if os.environ.get("PSREC_MALLOC_TUNING", "1") == "0" or libc is None:
        return False
    if any(name in os.environ for name in SETTINGS):
        return False  # the user's own settings: glibc read them at start
    applied = True
    for name, value in SETTINGS.items():
        if libc.mallopt(_PARAMETERS[name], value) != 1:
            applied = False
            logger.debug("mallopt(%s, %d) was refused", name, value)
        os.environ[name] = str(value)
    return applied


def release_free_memory(*, pools: bool = True) -> bool:
    """Drop the free arrays of every `ReusableBuffers` pool (unless `pools` is False), then return
    the free memory of every malloc arena to the system (glibc's ``malloc_trim(0)``); True when
    malloc released some. Live memory is untouched: what the process allocates next faults its
    pages in again."""
    started = time.perf_counter()
    dropped = sum(pool.release_free() for pool in list(_POOLS)) if pools else 0
    libc = _libc()
    released = bool(libc.malloc_trim(0)) if libc is not None else False
    logger.debug(
        "released %.1f MiB of pooled buffers; malloc_trim released memory: %s (%.1f ms)",
        dropped / 2**20,
        released,
        1000 * (time.perf_counter() - started),
    )
    return released


_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23
_PAGE_BYTES = 4096


def advise_huge_pages(array: np.ndarray) -> bool:
    """madvise(MADV_HUGEPAGE) the pages under `array`'s memory; True if the kernel accepted it.

    Pages already touched keep their size until the kernel's khugepaged merges them: advise memory
    before writing it (see `psrec.embedding.arrays.grow_rows`)."""
    if os.environ.get("PSREC_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if libc is None or array.nbytes == 0:
        return False
    start = array.ctypes.data & ~(_PAGE_BYTES - 1)
    length = array.ctypes.data + array.nbytes - start
    return bool(libc.madvise(start, length, _MADV_HUGEPAGE) == 0)


def populate(array: np.ndarray) -> bool:
    """Fault in (write-populate) every page under `array`'s memory now; its contents are unchanged.
    True when the kernel did it in one call, False when every page was written instead."""
    if array.nbytes == 0:
        return False
    libc = _libc()
    if libc is not None and sys.platform.startswith("linux"):
        start = array.ctypes.data & ~(_PAGE_BYTES - 1)
        length = array.ctypes.data + array.nbytes - start
        if libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0:
            return True
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("populate needs a writeable C-contiguous array")
    pages = array.reshape(-1).view(np.uint8)[::_PAGE_BYTES]
    np.add(pages, 0, out=pages)  # a write per page (an assignment of itself would be skipped)
    return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


REUSE_MIN_BYTES = 1 << 20  # smaller arrays come from malloc's free lists anyway
_POOLS: weakref.WeakSet[ReusableBuffers] = weakref.WeakSet()  # every live pool
_SLACK = 1.25  # a new array's spare capacity: later steps need a few more rows than this one


class ReusableBuffers:
    """Scratch arrays reused once nothing outside this pool refers to them.

    ``empty(shape, dtype)`` returns an uninitialised C-contiguous array, a view of a cached one
    when some cached array is free and large enough, else of a new one (with 25% spare capacity).
    An array is free when only the pool holds it (CPython's reference count, as NumPy's own
    ``ndarray.resize`` checks): the view handed out, any view of it and any torch tensor made from
    it (``torch.from_numpy``) keep it busy, so an array is never handed out twice while in use,
    whatever the caller keeps. At most `keep` arrays are cached; below ``REUSE_MIN_BYTES`` arrays
    are plain ``np.empty``.
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0
        _POOLS.add(self)  # for `release_free_memory`

    def release_free(self) -> int:
        """Drop the cached arrays nothing outside the pool refers to; returns their bytes. Busy
        arrays stay (their users free them, and the pool keeps them for reuse)."""
        with self._lock:
            # references of a free array: the list's and getrefcount's argument
            free = [sys.getrefcount(self._arrays[index]) == 2 for index in range(len(self._arrays))]
            dropped = sum(array.nbytes for array, is_free in zip(self._arrays, free, strict=True) if is_free)
            self._arrays = [array for array, is_free in zip(self._arrays, free, strict=True) if not is_free]
        return dropped

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if nbytes < REUSE_MIN_BYTES:
            return np.empty(shape, dtype)
        with self._lock:
            for index in range(len(self._arrays)):
                # references: the list's and getrefcount's argument; anything more is a user
                if self._arrays[index].nbytes >= nbytes and sys.getrefcount(self._arrays[index]) == 2:
                    self.reused += 1
                    return self._arrays[index][:nbytes].view(dtype).reshape(shape)
            fresh = np.empty(int(nbytes * _SLACK), np.uint8)
            self.allocated += 1
            self._arrays.append(fresh)
            if len(self._arrays) > self.keep:
                self._forget_one()
            return fresh[:nbytes].view(dtype).reshape(shape)

    def _forget_one(self) -> None:
        """Drop the smallest free array (a busy one stays with its users and is freed by them)."""
        free = [i for i in range(len(self._arrays) - 1) if sys.getrefcount(self._arrays[i]) == 2]
        candidates = free or range(len(self._arrays) - 1)
        del self._arrays[min(candidates, key=lambda i: self._arrays[i].nbytes)]
