"""Start-up time of a run: from the program's start, and from the `train()` call, to the end of its
first training step (in `summary.json` under ``startup``), and `paused_gc` for the start-up's imports.

Every figure is a difference of wall-clock readings (`time.time()`) taken by the run itself: the
program's start is the time the `psrec` command's entry point read first thing (`psrec.cli.main`),
passed to `train(started_at=...)`; a library call of `train()` without it counts from the call. The
process's start time that Linux keeps (/proc/self/stat, in clock ticks since boot) is not used: it
is on the boot clock, and turning it into wall-clock time takes the boot clock's difference from the
wall clock, which jumps on a virtual machine that is paused or restored (docs/benchmarks.md,
"Start-up").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def startup_report(
    first_step_at: float | None, *, train_called_at: float, started_at: float | None = None
) -> dict[str, float | None]:
    """Seconds to the end of the first step (`first_step_at`, wall clock; None when no step ran):
    from the program's start (`started_at`; the `train()` call when None) as
    ``seconds_to_first_step``, and from the `train()` call as ``seconds_from_train_call``."""
    if first_step_at is None:
        return {"seconds_to_first_step": None, "seconds_from_train_call": None}
    started = train_called_at if started_at is None else started_at
    return {
        "seconds_to_first_step": first_step_at - started,
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
