"""Thread counts of one process: torch, numba and OpenMP, set explicitly.

Shard and trainer processes share cores; left at their defaults, each library starts a thread per
core and their OpenMP waiters spin on each other. Every process psrec starts calls `set_thread_counts`
first.

`PARALLEL_LAUNCH` serialises the launches of numba's parallel kernels (the bag pooling, the
embedding tables' batch kernels): numba's workqueue threading layer, the one it falls back to where
neither OpenMP nor TBB loads, aborts the process when two Python threads launch parallel kernels at
once. With OpenMP or TBB the lock costs an uncontended acquire.
"""

from __future__ import annotations

import os
import sys
import threading

PARALLEL_LAUNCH = threading.Lock()


def set_thread_counts(threads: int) -> None:
    """Pin torch/numba/OpenMP threads: processes sharing cores must not spin-wait on each other.

    A process that has not imported torch (a shard) does not import it here (about 0.8 s of CPU per
    process, beside the trainer's own imports); one that imports it later calls this again."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    except (ImportError, ValueError):  # pragma: no cover
        pass
