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

`advise_huge_pages` asks Linux for transparent huge pages (2 MiB) under a large array, e.g. an
embedding table's rows. Lookups hit rows at random across hundreds of MiB: with 4 KiB pages nearly
each one also misses the TLB. Where THP is in ``madvise`` mode (as on the machine of
docs/benchmarks.md), only advised memory gets huge pages; in ``always`` mode the call changes nothing
and in ``never`` mode it has no effect. Set ``PSREC_HUGE_PAGES=0`` to skip it.

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
