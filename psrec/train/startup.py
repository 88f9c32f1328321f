"""Start-up time of a run: from the process's start, and from the `train()` call, to the end of its
first training step (in `summary.json` under ``startup``), and `paused_gc` for the start-up's imports.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator


def process_start_time() -> float | None:
    """Wall-clock time (seconds since the epoch) this process started, or None where /proc is not.

    Linux gives the start in clock ticks since boot (/proc/self/stat, field 22); boot time is now
    minus the time since boot (CLOCK_BOOTTIME, which keeps counting through suspend as /proc does).
    """
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        ticks = int(fields[19])  # field 22 of the whole line; fields[0] is field 3
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


def startup_report(first_step_at: float | None, *, train_called_at: float) -> dict[str, float | None]:
    """Seconds from the process's start and from the `train()` call to the end of the first step
    (None when no step ran)."""
    started = process_start_time()
    if first_step_at is None:
        return {"seconds_to_first_step": None, "seconds_from_train_call": None}
    return {
        "seconds_to_first_step": None if started is None else first_step_at - started,
        "seconds_from_train_call": first_step_at - train_called_at,
    }


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was after it.

    Start-up imports torch, numba and pyarrow and builds the model: hundreds of thousands of
    long-lived objects, over which every collection of the oldest generation walks again; importing
    torch and `torch._dynamo` (which `training.compile` loads) took 2.1-2.2 s with the collector
    off against 2.5-2.7 s with it on (docs/benchmarks.md, "Start-up"). Nested blocks leave it to the
    outermost one to turn it back on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
