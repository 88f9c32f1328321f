"""Changing the trainer count while training: the pause of the switch, and the start of added trainers.

The quickstart job (Ray, sync, shard failover off) trains `--steps` steps; `psrec scale --trainers`
is written at step `--at`. Each round runs two jobs, interleaved: 2 -> 1 trainers and 1 -> 2
trainers. Reported, medians over `--rounds` rounds:

- the switch's pause at its step boundary (the driver's call: every trainer's position, the data
  dealt, trainer 0's replica loaded by each trainer of the new set, the shards' count, the group
  formed again), and its parts;
- for growing, the start of the added trainer (request -> it answers; training goes on meanwhile)
  and the step the switch landed on;
- the wall time of the chunk of steps right after the switch (5 steps, the switch included) against
  the median chunk before the request: what the change costs the job, start -> training again.

    python -m psrec.bench.trainer_scale_bench [--rows 200000] [--steps 300] [--at 20] [--rounds 3]

Timings depend on the machine's load: state it (`uptime`) with every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from psrec.bench import EXAMPLES
from psrec.cluster.start import start_ray
from psrec.config import load_config
from psrec.elastic.resharding import request_scale
from psrec.train.data_sources import prepare_data
from psrec.train.loop import train
from psrec.train.runtime import RayRuntime

QUICKSTART = EXAMPLES / "quickstart.yaml"


def run(args: argparse.Namespace, run_dir: str, *, trainers: int, to: int) -> dict[str, Any]:
    """One job from `trainers` to `to` trainers; its scale entry and the chunk times around it."""
    overrides = {
        "run_dir": run_dir,
        "data.synthetic.train_rows": args.rows,
        "ps.num_trainers": trainers,
        "fault_tolerance.shard_failover": False,
        "checkpoint.every_steps": 1000,  # no checkpoint inside the measured chunks
        "training.log_every_steps": 5,
        "training.max_steps": args.steps,
        "training.epochs": 10,  # max_steps ends the job
    }
    config = load_config(args.config, overrides=overrides)
    runtime = RayRuntime(config, base_dir=".", data_sources=prepare_data(config, base_dir=Path(".")))
    reports: list[tuple[float, int]] = []

    def progress(report: dict[str, Any]) -> None:
        reports.append((time.perf_counter(), report["step"]))
        if report["step"] == args.at:
            request_scale(run_dir, trainers=to)

    try:
        summary = train(config, runtime=runtime, progress=progress)
    finally:
        runtime.shutdown()
    entry = summary["resharding"][-1]
    if entry["state"] != "done":
        raise RuntimeError(f"the change did not happen: {entry}")
    step = entry["switch"]["step"]
    at = dict((s, t) for t, s in reports)
    before = [at[s] - at[s - 5] for s in range(10, args.at + 1, 5)]
    return {
        "pause": entry["switch"]["seconds"],
        "parts": {k: entry["switch"][k] for k in ("deal_seconds", "replica_seconds", "group_seconds")},
        "start": entry.get("start_seconds", 0.0),
        "step": step,
        "chunk_after": at[step + 5] - at[step],
        "chunk_before": statistics.median(before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(QUICKSTART))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    start_ray(None, num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    results: dict[str, list[dict[str, Any]]] = {"2 -> 1": [], "1 -> 2": []}
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.rounds):
            for name, (trainers, to) in (("2 -> 1", (2, 1)), ("1 -> 2", (1, 2))):
                result = run(args, f"{scratch}/{number}-{trainers}-{to}", trainers=trainers, to=to)
                results[name].append(result)
                print(f"round {number} {name}: {result}", flush=True)
    print(f"load: {os.getloadavg()}")
    for name, rounds in results.items():
        median = {
            key: statistics.median(r[key] for r in rounds)
            for key in ("pause", "start", "chunk_after", "chunk_before")
        }
        parts = {key: statistics.median(r["parts"][key] for r in rounds) for key in rounds[0]["parts"]}
        steps = [r["step"] for r in rounds]
        print(
            f"{name}: pause {median['pause'] * 1000:.0f} ms (deal {parts['deal_seconds'] * 1000:.0f}, replica "
            f"{parts['replica_seconds'] * 1000:.0f}, group {parts['group_seconds'] * 1000:.0f} ms); start "
            f"{median['start']:.1f} s; switched at steps {steps}; chunk of 5 steps after "
            f"{median['chunk_after']:.2f} s vs {median['chunk_before']:.2f} s before"
        )


if __name__ == "__main__":
    main()
