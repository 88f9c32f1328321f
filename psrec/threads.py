"""Thread counts of one process: torch (ATen, OpenMP, MKL) and numba, set explicitly.

Shard and trainer processes share cores; left at their defaults, each library starts a thread per
core and their OpenMP waiters spin on each other. Every process psrec starts calls `set_thread_counts`
first, and again once it has imported torch.

The counts are also part of psrec's exactness promise. MKL's GEMMs split their work by the number of
threads, and on some CPUs (Intel's) the split changes the order of the sums, so a dense step with two
threads differs in the last bits from the same step with one. A trainer on Ray and the same trainer in
the driver's process give the same bits only when both use the configured counts. Each library
keeps part of its setting per thread: MKL's count set through torch (`mkl_set_num_threads_local`)
and numba's (`numba.set_num_threads`) hold for the calling thread only, and a thread that never set
them uses the library's default (the number of cores, or ``MKL_NUM_THREADS``). So psrec sets the
counts in every thread that computes (`apply_thread_counts`, called by the threads psrec starts), and
puts them into the environment too, where a library that loads later and the processes this one
starts read their defaults. `compute_settings` reports what the calling thread computes with.

`PARALLEL_LAUNCH` serialises the launches of numba's parallel kernels (the bag pooling, the DLRM
interaction, the embedding tables' batch kernels): numba's workqueue threading layer, the one it
falls back to where neither OpenMP nor TBB loads, aborts the process when two Python threads launch
parallel kernels at once. With OpenMP or TBB the lock costs an uncontended acquire.
"""

from __future__ import annotations

import os
import re
import sys
import threading

PARALLEL_LAUNCH = threading.Lock()

# variables libraries read their default thread count from, when they load or start a thread
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_configured: list[int] = []  # the count set_thread_counts last set in this process (none: never)


def set_thread_counts(threads: int) -> None:
    """Pin torch/MKL/OpenMP/numba threads to `threads` in this process and thread, and make it the
    default of threads and libraries that start later (see the module docstring).

    A process that has not imported torch (a shard) does not import it here (about 0.8 s of CPU per
    process, beside the trainer's own imports); one that imports it later calls this again."""
    if threads < 1:
        raise ValueError(f"thread count must be >= 1, got {threads}")
    _configured[:] = [threads]
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    apply_thread_counts()


def configured_threads() -> int | None:
    """The count `set_thread_counts` set in this process, or None if it was never called."""
    return _configured[0] if _configured else None


def apply_thread_counts() -> None:
    """Set the process's configured counts in the calling thread (MKL's and numba's counts are the
    thread's own); does nothing before `set_thread_counts`. Every thread psrec starts to compute
    calls it first."""
    threads = configured_threads()
    if threads is None:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)  # ATen's count, OpenMP's and MKL's for this thread
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    except (ImportError, ValueError):  # pragma: no cover
        pass


def compute_settings() -> dict[str, int | str]:
    """What the calling thread computes with: thread counts ``torch`` (ATen's intra-op pool),
    ``openmp`` and ``mkl`` (torch's OpenMP and MKL, as `torch.__config__.parallel_info` reports them
    for this thread), ``numba``, and ``cpu_capability``, the vector instruction set ATen dispatches
    its kernels to (``ATEN_CPU_CAPABILITY`` lowers it). Two processes that must give the same bits
    report the same settings; a library not imported in this process is left out."""
    settings: dict[str, int | str] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        settings["torch"] = torch.get_num_threads()
        info = torch.__config__.parallel_info()
        for key, function in (("openmp", "omp_get_max_threads"), ("mkl", "mkl_get_max_threads")):
            match = re.search(rf"{function}\(\) : (\d+)", info)
            if match:
                settings[key] = int(match.group(1))
        settings["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    numba = sys.modules.get("numba")
    if numba is not None:
        settings["numba"] = numba.get_num_threads()
    return settings
