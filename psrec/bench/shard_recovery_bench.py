"""Recovery of one shard holding N rows: failover (checkpoint file + log replay) against a rollback.

One logged shard actor (Ray, `max_restarts`) is filled with `--rows` rows of dim `--dim`
(row-wise Adagrad), checkpointed, then given `--steps` pushes of `--batch` rows each (what a
checkpoint interval logs); a second shard serves a driver thread's pull + push steps throughout.
Shard 0 is then SIGKILLed and the bench times, in one run:

- **failover**: kill -> shard 0 answering a pull again (Ray restarting it, loading its checkpoint
  file, replaying the log), and the other shard's steps per second before and during it;
- **rollback** of the same shard: kill -> a new actor without a log restored from the same
  checkpoint (what the whole-job rollback does for every shard, in parallel), to which the rollback
  adds the trainers' restart and the `--steps` steps computed again;
- the log's size per push (bytes on disk, seconds writing).

    python -m psrec.bench.shard_recovery_bench --rows 1000000 --dim 64
    python -m psrec.bench.shard_recovery_bench --rows 10000000 --dim 64

State the machine's load (`uptime`) with every figure; the bench prints it.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from psrec import checkpoint
from psrec.checkpoint.policy import checkpoint_chain
from psrec.cluster.start import start_ray
from psrec.embedding import SparseOptimizerSpec, TableSpec
from psrec.ps.replay import prepare_fresh
from psrec.ps.shard import ParameterShard

FILL_BATCH = 1_000_000


def load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def commit(actor: Any, run_dir: Path, step: int) -> list[Any]:
    """A full checkpoint of `actor` at `step`, committed; the shard's log starts again from it."""
    import ray

    pending = checkpoint.begin_checkpoint(run_dir, step=step, kind="full")
    record = ray.get(actor.write_checkpoint.remote(pending, "full"))
    ref = checkpoint.commit_checkpoint(
        pending,
        shard_files={0: record},
        dense={},
        trainers=[],
        extra={},
        config={},
        bucket_map=[0],
        parent=None,
    )
    ray.get(actor.call.remote(ParameterShard.confirm_checkpoint))
    chain = checkpoint_chain(ref, checkpoint.list_checkpoints(run_dir))
    assert isinstance(chain, list)
    ray.get(actor.checkpointed.remote(chain))
    return chain


class OtherShard:
    """A driver thread stepping against the other shard: pull `batch` rows, push their gradients."""

    def __init__(self, actor: Any, *, batch: int, dim: int) -> None:
        self.actor, self.batch, self.dim = actor, batch, dim
        self.times: list[float] = []  # the end of every step
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import ray

        rng = np.random.default_rng(1)
        step = 0
        while not self.stop.is_set():
            ids = np.unique(rng.integers(0, 1_000_000, self.batch))
            ray.get(self.actor.pull.remote({"t": ids}, True))
            grads = rng.normal(size=(ids.size, self.dim)).astype(np.float32)
            ray.get(self.actor.push.remote(0, step, step, {"t": (ids, grads)}))
            step += 1
            self.times.append(time.perf_counter())

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t in self.times if start < t <= end) / max(end - start, 1e-9)


def wait_serving(actor: Any, ids: np.ndarray, *, timeout: float = 900.0) -> float:
    """Poll `actor` with a pull until it answers; returns when it did (perf_counter)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pull.remote({"t": ids}, False), timeout=timeout)
            return time.perf_counter()
        except Exception:  # noqa: BLE001 - restarting: ask again
            time.sleep(0.01)
    raise TimeoutError(f"the shard did not answer within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="pushes logged since the checkpoint")
    parser.add_argument("--batch", type=int, default=8192, help="rows per push")
    args = parser.parse_args()

    import ray

    from psrec.ps.actors import ShardActor

    start_ray(None, num_cpus=4)
    spec = [TableSpec("t", args.dim, SparseOptimizerSpec("rowwise_adagrad", lr=0.1))]
    with tempfile.TemporaryDirectory(prefix="psrec-recovery-") as tmp:
        root = Path(tmp)
        log_dir = root / "log"
        prepare_fresh(log_dir)
        logged: Any = ray.remote(max_restarts=1)(ShardActor)
        shard = logged.remote(0, spec, num_trainers=1, mode="sync", push_log=str(log_dir))
        other: Any = ray.remote(ShardActor).remote(1, spec, num_trainers=1, mode="sync")
        ray.get([shard.pid.remote(), other.pid.remote()])
        started = time.perf_counter()
        for first in range(0, args.rows, FILL_BATCH):
            ids = np.arange(first, min(first + FILL_BATCH, args.rows), dtype=np.int64)
            ray.get(shard.pull.remote({"t": ids}, True))
        chain = commit(shard, root / "run", step=0)
        size = sum(f.stat().st_size for f in (chain[-1].path).iterdir())
        print(
            f"filled {args.rows:,} rows x dim {args.dim} and checkpointed in {time.perf_counter() - started:.1f} s"
        )
        written = ray.get(shard.failover_report.remote())
        rng = np.random.default_rng(0)
        for step in range(args.steps):
            ids = np.unique(rng.integers(0, args.rows, args.batch))
            grads = rng.normal(size=(ids.size, args.dim)).astype(np.float32)
            ray.get(shard.pull.remote({"t": ids}, True, "trainer-0", step + 1))
            ray.get(shard.push.remote(0, step, step, {"t": (ids, grads)}))
        report = ray.get(shard.failover_report.remote())
        probe = np.arange(16, dtype=np.int64)
        expected = ray.get(shard.pull.remote({"t": probe}, False))["t"]

        stepping = OtherShard(other, batch=args.batch, dim=args.dim)
        stepping.thread.start()
        time.sleep(5.0)
        killed = time.perf_counter()
        os.kill(ray.get(shard.pid.remote()), signal.SIGKILL)
        serving = wait_serving(shard, probe)
        rebuilt = ray.get(shard.failover_report.remote())["recovery"]
        time.sleep(2.0)
        stepping.stop.set()
        stepping.thread.join(timeout=60)
        got = ray.get(shard.pull.remote({"t": probe}, False))["t"]
        assert np.array_equal(got, expected), "the rebuilt shard differs from the one killed"

        # The rollback of this shard: a new actor (no log) restored from the same checkpoint.
        ray.kill(shard, no_restart=True)
        plain: Any = ray.remote(ShardActor)
        rollback_start = time.perf_counter()
        fresh = plain.remote(0, spec, num_trainers=1, mode="sync")
        ray.get(fresh.restore.remote(chain, 0))
        rollback_s = time.perf_counter() - rollback_start

        before = stepping.rate(killed - 5.0, killed)
        during = stepping.rate(killed, serving)
        steps = max(1, args.steps)
        log_bytes = rebuilt["log_bytes"]  # the segment replayed: everything since the checkpoint
        writing = report["seconds_writing"] - written["seconds_writing"]
        print(
            f"load {load()}; driver peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
        )
        print(f"checkpoint of the shard: {size / 2**20:.1f} MiB")
        print(
            f"failover: kill -> serving {serving - killed:.2f} s (process start -> checkpoint loaded "
            f"{rebuilt['restored'] - rebuilt['started']:.2f} s, log replay of {rebuilt['operations_replayed']} "
            f"operations / {rebuilt['log_bytes'] / 2**20:.1f} MiB {rebuilt['ready'] - rebuilt['restored']:.2f} s)"
        )
        print(
            f"rollback of the same shard: new actor + restore {rollback_s:.2f} s, then the trainers' "
            f"restart and {args.steps} steps computed again"
        )
        print(f"other shard: {before:.1f} steps/s before the kill, {during:.1f} during the recovery")
        print(
            f"log: {log_bytes / 2**20:.1f} MiB for {args.steps} steps of {args.batch} rows "
            f"({log_bytes / steps / 2**20:.2f} MiB and {writing / steps * 1e3:.1f} ms of writing per step)"
        )
        ray.kill(fresh)
        ray.kill(other)


if __name__ == "__main__":
    main()
