"""Shard failover against whole-job rollback, on the quickstart model (Ray, 1 trainer + 2 shards, sync).

1. **Recovery**: the same job twice, once with `fault_tolerance.shard_failover` off (today's
   rollback) and once on; shard 0 is SIGKILLed at step 1.5 x `--every` (halfway between two
   checkpoints). Reported: kill -> training again (rollback) or kill -> the shard serving again
   (failover, with its parts: Ray starting the process, loading the checkpoint file, replaying the
   log), the steps recomputed, and the final validation AUC of both.
2. **Cost of the log** per step: `--rounds` undisturbed runs of `--steps` steps with failover off and
   on, interleaved, medians of the training throughput; the bytes and seconds the shards spend
   logging per step; and what the alternative design, each trainer keeping its pushes since the last
   checkpoint, would hold in memory (pushed bytes per step x `--every`).

    python -m psrec.bench.failover_bench [--rows 200000] [--every 40] [--steps 200] [--rounds 3]
    python -m psrec.bench.failover_bench --skip-cost --cardinality-scale 0.2   # bigger tables

Timings depend on the machine's load: state it with every figure.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from psrec.bench import EXAMPLES
from psrec.cluster.start import start_ray
from psrec.config import load_config
from psrec.train.data_sources import prepare_data
from psrec.train.loop import train
from psrec.train.runtime import RayRuntime

QUICKSTART = EXAMPLES / "quickstart.yaml"


def run(
    args: argparse.Namespace, run_dir: str, *, failover: bool, kill_at: int | None, **extra: Any
) -> dict[str, Any]:
    """One training run; returns its summary plus the kill and the shards' log reports."""
    import ray

    overrides = {
        "run_dir": run_dir,
        "data.synthetic.train_rows": args.rows,
        "data.synthetic.cardinality_scale": args.cardinality_scale,
        "checkpoint.every_steps": args.every,
        "training.log_every_steps": 5,
        "fault_tolerance.shard_failover": failover,
        **extra,
    }
    config = load_config(args.config, overrides=overrides)
    runtime = RayRuntime(config, base_dir=".", data_sources=prepare_data(config, base_dir=Path(".")))
    killed: dict[str, Any] = {}

    def kill(report: dict[str, Any]) -> None:
        if kill_at is not None and not killed and report["step"] >= kill_at:
            pid = ray.get(runtime.shards[0].pid.remote())
            killed.update(pid=pid, step=report["step"], at=time.time())
            os.kill(pid, signal.SIGKILL)

    try:
        summary = train(config, runtime=runtime, progress=kill)
        reports = runtime.failover_reports()
    finally:
        runtime.shutdown()
    return {"summary": summary, "killed": killed, "reports": reports}


def recovery(args: argparse.Namespace, tmp: str) -> None:
    kill_at = args.kill_at if args.kill_at is not None else args.every * 3 // 2
    for failover in (False, True):
        result = run(args, f"{tmp}/recovery-{failover}", failover=failover, kill_at=kill_at)
        summary, killed = result["summary"], result["killed"]
        auc = summary["validation"]["auc"]
        if not failover:
            (back,) = summary["recoveries"]
            print(
                f"rollback: shard 0 killed at step {killed['step']}; training again "
                f"{back['at'] - killed['at']:.1f} s after the kill, rolled back to step {back['restored_step']} "
                f"({killed['step'] - back['restored_step']} steps recomputed, every shard and trainer "
                f"restored); steps {summary['steps']}, validation AUC {auc:.4f}",
                flush=True,
            )
            continue
        rebuilt = result["reports"][0]["recovery"]
        total_rows = sum(table["rows"] for table in summary["tables"].values())
        print(f"tables: {total_rows:,} rows over 2 shards at the end of the run", flush=True)
        print(
            f"failover: shard 0 killed at step {killed['step']}; serving again "
            f"{rebuilt['ready'] - killed['at']:.1f} s after the kill (Ray restarting the process "
            f"{rebuilt['started'] - killed['at']:.1f} s, imports + checkpoint file of step {rebuilt['base_step']} "
            f"{rebuilt['restored'] - rebuilt['started']:.1f} s, replaying {rebuilt['operations_replayed']} "
            f"logged operations ({rebuilt['pushes_replayed']} pushes, {rebuilt['log_bytes'] / 2**20:.1f} MiB) "
            f"{rebuilt['ready'] - rebuilt['restored']:.2f} s); rollbacks {len(summary['recoveries'])}, "
            f"0 steps recomputed, shard 1 restored {result['reports'][1]['restores']} times; "
            f"steps {summary['steps']}, validation AUC {auc:.4f}",
            flush=True,
        )


def log_cost(args: argparse.Namespace, tmp: str) -> None:
    throughput: dict[bool, list[float]] = {False: [], True: []}
    logged: list[tuple[float, float]] = []  # (bytes, seconds) the shards logged per step
    pushed = 0.0
    for round_index in range(args.rounds):
        for failover in (False, True):
            result = run(
                args,
                f"{tmp}/cost-{round_index}-{failover}",
                failover=failover,
                kill_at=None,
                **{"training.max_steps": args.steps},
            )
            summary = result["summary"]
            throughput[failover].append(summary["samples_per_second"])
            batch = summary["samples"] / summary["steps"]
            pushed = summary["bytes_pushed_per_sample"] * batch
            if failover:
                reports = [r for r in result["reports"] if r is not None]
                logged.append(
                    (
                        sum(r["bytes_written"] for r in reports) / summary["steps"],
                        sum(r["seconds_writing"] for r in reports) / summary["steps"],
                    )
                )
    off, on = statistics.median(throughput[False]), statistics.median(throughput[True])
    log_bytes = statistics.median(b for b, _ in logged)
    log_seconds = statistics.median(s for _, s in logged)
    print(
        f"log cost ({args.rounds} rounds of {args.steps} steps, interleaved, medians): training "
        f"{off:,.0f} samples/s without the log, {on:,.0f} with it (ratio {on / off:.3f}; samples/s per "
        f"round off {[round(x) for x in throughput[False]]}, on {[round(x) for x in throughput[True]]}); the "
        f"shards log {log_bytes / 2**20:.2f} MiB per step in {log_seconds * 1e3:.2f} ms per step (both shards); "
        f"a trainer pushes {pushed / 2**20:.2f} MiB per step, so trainer-side buffers would hold "
        f"{pushed * args.every / 2**20:.0f} MiB per trainer at a checkpoint every {args.every} steps",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(QUICKSTART))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument(
        "--cardinality-scale", type=float, default=0.01, help="more distinct ids: bigger tables"
    )
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=None, help="step of the kill (default 1.5 x --every)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()

    import ray

    start_ray(None, num_cpus=4)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if not args.skip_recovery:
                recovery(args, tmp)
            if not args.skip_cost:
                log_cost(args, tmp)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
