"""Changing the shard count while training: the pause per bucket move and the throughput meanwhile.

The quickstart job (Ray, 1 trainer, sync) trains `--steps` steps on 2 shards, twice per round,
interleaved: once undisturbed, once with `psrec scale`'s request to `--to` shards written at step
`--at` (the driver starts the new shards in the background, then moves `--buckets-per-round`
virtual buckets per step boundary, every 5 steps). Reported, medians over `--rounds` rounds:

- the pause of each round of moves (copy rows + optimizer state, switch every trainer's map, drop
  the old copy), per round and per bucket, and the rows moved;
- the start of the new shard actors (request -> they answer; training goes on meanwhile);
- the throughput (samples/s) from the request to the end of the last round, and over the rounds of
  moves alone, against the same steps of the undisturbed run, and the final validation AUC of both
  (equal in sync mode).

    python -m psrec.bench.reshard_bench [--rows 400000] [--steps 300] [--at 40] [--to 4] [--rounds 3]

Timings depend on the machine's load: state it (`uptime`) with every figure.
"""

from __future__ import annotations

import argparse
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


def run(args: argparse.Namespace, run_dir: str, *, scale: bool) -> dict[str, Any]:
    """One job; its summary and (seconds, step, samples) at every progress report."""
    overrides = {
        "run_dir": run_dir,
        "data.synthetic.train_rows": args.rows,
        "data.synthetic.cardinality_scale": args.cardinality_scale,
        "checkpoint.every_steps": args.every,
        "training.log_every_steps": 5,
        "training.max_steps": args.steps,
        "training.epochs": 10,  # max_steps ends the job
    }
    config = load_config(args.config, overrides=overrides)
    runtime = RayRuntime(config, base_dir=".", data_sources=prepare_data(config, base_dir=Path(".")))
    reports: list[tuple[float, int, int]] = []

    def progress(report: dict[str, Any]) -> None:
        reports.append((time.perf_counter(), report["step"], report["samples"]))
        if scale and report["step"] == args.at:
            request_scale(run_dir, args.to, buckets_per_round=args.buckets_per_round)

    try:
        summary = train(config, runtime=runtime, progress=progress)
    finally:
        runtime.shutdown()
    return {"summary": summary, "reports": reports}


def throughput(reports: list[tuple[float, int, int]], first: int, last: int) -> float:
    """Samples/s between the reports of steps `first` and `last`."""
    at = {step: (seconds, samples) for seconds, step, samples in reports}
    (start, before), (end, after) = at[first], at[last]
    return (after - before) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(QUICKSTART))
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=40, help="checkpoint every N steps")
    parser.add_argument("--at", type=int, default=40, help="step of the scale request (a multiple of 5)")
    parser.add_argument("--to", type=int, default=4)
    parser.add_argument("--buckets-per-round", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray

    start_ray(None, num_cpus=4)
    pauses, per_bucket, rows_moved, starts, during, steady, aucs = [], [], [], [], [], [], []
    moving, moving_steady = [], []  # the steps of the moves alone (new shards already answering)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_index in range(args.rounds):
                base = run(args, f"{tmp}/steady-{round_index}", scale=False)
                scaled = run(args, f"{tmp}/scaled-{round_index}", scale=True)
                (entry,) = scaled["summary"]["resharding"]
                assert entry["state"] == "done", entry
                rounds = entry["rounds"]
                last = rounds[-1]["step"] + 5
                pauses += [r["seconds"] for r in rounds]
                per_bucket += [r["seconds"] / r["buckets"] for r in rounds]
                rows_moved.append(sum(r["rows"] for r in rounds))
                starts.append(entry.get("start_seconds", 0.0))
                during.append(throughput(scaled["reports"], args.at, last))
                steady.append(throughput(base["reports"], args.at, last))
                moving.append(throughput(scaled["reports"], rounds[0]["step"], last))
                moving_steady.append(throughput(base["reports"], rounds[0]["step"], last))
                aucs.append((base["summary"]["validation"]["auc"], scaled["summary"]["validation"]["auc"]))
                print(
                    f"round {round_index}: {len(rounds)} rounds of moves at steps {[r['step'] for r in rounds]}, "
                    f"pauses {[round(r['seconds'], 3) for r in rounds]} s, {rows_moved[-1]:,} rows moved; "
                    f"new shards answered {starts[-1]:.1f} s after the request; samples/s steps {args.at}-{last}: "
                    f"{during[-1]:,.0f} resharding vs {steady[-1]:,.0f} undisturbed, steps {rounds[0]['step']}-{last} "
                    f"(the moves): {moving[-1]:,.0f} vs {moving_steady[-1]:,.0f}; AUC {aucs[-1]}",
                    flush=True,
                )
    finally:
        ray.shutdown()
    print(
        f"2 -> {args.to} shards, {args.buckets_per_round} buckets per round (medians of {args.rounds} rounds): "
        f"pause per round {statistics.median(pauses) * 1e3:.0f} ms (max {max(pauses) * 1e3:.0f} ms), "
        f"per bucket {statistics.median(per_bucket) * 1e3:.2f} ms; {statistics.median(rows_moved):,.0f} rows "
        f"moved; new shards answering {statistics.median(starts):.1f} s after the request; throughput "
        f"while resharding {statistics.median(during):,.0f} samples/s vs {statistics.median(steady):,.0f} "
        f"undisturbed (ratio {statistics.median(d / s for d, s in zip(during, steady, strict=True)):.2f}), "
        f"over the moves alone {statistics.median(moving):,.0f} vs {statistics.median(moving_steady):,.0f} "
        f"(ratio {statistics.median(m / s for m, s in zip(moving, moving_steady, strict=True)):.2f}); "
        f"AUC equal in every round: {all(a == b for a, b in aucs)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
