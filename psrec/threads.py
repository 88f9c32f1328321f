"""Thread counts of one process: torch, numba and OpenMP, set explicitly.

Shard and trainer processes share cores; left at their defaults, each library starts a thread per
core and their OpenMP waiters spin on each other. Every process psrec starts calls `set_thread_counts`
first.
"""

from __future__ import annotations

import os


def set_thread_counts(threads: int) -> None:
    """Pin torch/numba/OpenMP threads: processes sharing cores must not spin-wait on each other."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    except (ImportError, ValueError):  # pragma: no cover
        pass
