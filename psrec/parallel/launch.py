"""Run a function on W local processes joined in a gloo process group: the one multi-process helper.

Used by the multi-process tests (`tests/parallel/`) and the parallelism measurements: it opens the
group's store socket on 127.0.0.1 (a free port), forks W processes (fork start method: nothing is
pickled but the results, and the function may be a closure), joins them in a gloo group that listens
on loopback only (`psrec.parallel.rendezvous`), runs ``fn(rank, world_size, *args)`` in each, collects
every rank's return value, and checks every rank's exit code::

    def step(rank: int, world_size: int) -> float:
        ...  # torch.distributed calls
        return loss

    losses = run_local_group(step, world_size=2)   # [loss of rank 0, loss of rank 1]

A rank that raises, exits non-zero or outlives `timeout` fails the call with every rank's error; the
helper kills only the processes it started. Each child uses one torch thread (forked OpenMP pools
can hang, and the CPU cores are shared).

``backend="cpu:gloo,cuda:nccl"`` (`rendezvous.backend_for("cuda")`) reduces GPU tensors with NCCL,
rank r on GPU r; the calling process must not have used CUDA before (a forked child cannot), so GPU
tests call it from a fresh interpreter.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from psrec.parallel import rendezvous

LOOPBACK = "127.0.0.1"


class GroupFailed(RuntimeError):
    """A rank raised, exited non-zero or timed out; the message holds every rank's error."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    listen_fd: int,
    args: tuple[Any, ...],
    results: Any,
    timeout: float,
    backend: str,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if rank != 0:
        os.close(listen_fd)  # the store socket forked into every rank belongs to rank 0
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        rendezvous.init_process_group(
            backend,
            master_address=LOOPBACK,
            master_port=port,
            rank=rank,
            world_size=world_size,
            local_address=LOOPBACK,
            listen_fd=listen_fd if rank == 0 else None,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # Plain pickle bytes: torch's queue reducers would share tensors by file descriptor, which
        # dies with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything: the parent re-raises with all ranks' errors
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def run_local_group(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, run in W forked processes (module docstring)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    listener = rendezvous.listen(LOOPBACK)
    port = listener.getsockname()[1]
    processes = [
        context.Process(
            target=_child,
            args=(fn, rank, world_size, port, listener.fileno(), args, results, timeout, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
    finally:
        listener.close()  # rank 0 holds its own copy
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    break
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and len(values) + len(errors) + len(dead) >= world_size:
                    time.sleep(0.2)  # let a dying rank's report arrive
                    if results.empty():
                        break
                continue
            if ok:
                values[rank] = pickle.loads(value)  # our own child's result
            else:
                errors[rank] = value
        for process in processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    for rank, process in enumerate(processes):
        if process.exitcode != 0 and rank not in errors:
            errors[rank] = f"exit code {process.exitcode}" + (" (timed out)" if rank not in values else "")
    if errors or len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values) - set(errors))
        for rank in missing:
            errors[rank] = "no result (timed out)"
        raise GroupFailed("\n".join(f"rank {rank}: {errors[rank]}" for rank in sorted(errors)))
    return [values[rank] for rank in range(world_size)]
