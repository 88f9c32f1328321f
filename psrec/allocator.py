"""glibc malloc settings for training processes: `tune_malloc`.

A training step allocates and frees the same large buffers every step (activations, gradients,
pulled rows). With glibc's defaults, blocks above the mmap threshold are mapped and unmapped each
time and the heap top is trimmed back to the system, so every step page-faults its buffers in again;
on the virtualised 2-core machine of docs/benchmarks-history.md (third session) that cost the
dense-only DLRM ceiling 1.46x in samples/s (1.06M minor faults in a 20-step run; 0.38M after).
PyTorch's CPU performance guides recommend the same remedy (jemalloc/tcmalloc, or these glibc
knobs): keep freed memory in the process for reuse. `tune_malloc` sets

- ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's dynamic maximum, fixed from the start), and
- ``M_TRIM_THRESHOLD`` to 1 GiB (free memory at the heap top is kept up to that much),

in this process (``mallopt``) and exports them as ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` for the processes it starts (bench systems, Ray workers). Memory freed
after a peak then stays mapped (up to 1 GiB per arena) instead of going back to the system.
Set ``PSREC_MALLOC_TUNING=0`` to keep glibc's defaults; MALLOC_* variables set by the user win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

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


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None
