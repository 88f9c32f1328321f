"""Parameter-server throughput: the quickstart model in-process vs on Ray (1x2, 2x2, async).

Runs every configuration once per round, rounds interleaved so machine noise hits all alike, and
prints the median samples/s, the ratio to in-process, bytes pulled/pushed per sample and the
validation AUC (sync vs async). Usage:

    python -m psrec.bench.ps_bench [--rows 400000] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from psrec.bench import EXAMPLES
from psrec.cluster.start import start_ray
from psrec.config import load_config
from psrec.train.loop import train

CONFIGS: dict[str, dict[str, Any]] = {
    "in-process (1 trainer, 2 local shards)": {"ps.runtime": "local"},
    "ray 1 trainer + 2 shards, sync": {"ps.runtime": "ray", "ps.num_trainers": 1},
    "ray 1 trainer + 2 shards, async k=2": {"ps.runtime": "ray", "ps.mode": "async", "ps.staleness": 2},
    "ray 2 trainers + 2 shards, sync": {"ps.runtime": "ray", "ps.num_trainers": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(EXAMPLES / "quickstart.yaml"))
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import ray

    start_ray(None, num_cpus=4)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name, overrides in CONFIGS.items():
                config = load_config(
                    args.config,
                    overrides={
                        **overrides,
                        "run_dir": f"{tmp}/{round_index}-{len(results[name])}-{abs(hash(name))}",
                        "data.synthetic.train_rows": args.rows,
                        "checkpoint.enabled": False,
                    },
                )
                summary = train(config, resume=False)
                results[name].append(summary)
                print(
                    f"round {round_index} {name}: {summary['samples_per_second']:.0f} samples/s", flush=True
                )
    ray.shutdown()

    base = statistics.median(s["samples_per_second"] for s in results[next(iter(CONFIGS))])
    rows = []
    print(
        f"\n{'configuration':45s} {'samples/s':>10s} {'ratio':>6s} {'pull B/s':>9s} {'push B/s':>9s} {'val AUC':>8s}"
    )
    for name, summaries in results.items():
        rate = statistics.median(s["samples_per_second"] for s in summaries)
        row = {
            "configuration": name,
            "samples_per_second": rate,
            "ratio_to_in_process": rate / base,
            "bytes_pulled_per_sample": summaries[-1]["bytes_pulled_per_sample"],
            "bytes_pushed_per_sample": summaries[-1]["bytes_pushed_per_sample"],
            "validation_auc": statistics.median(s["validation"]["auc"] for s in summaries),
            "phase_seconds": summaries[-1]["phase_seconds"],
        }
        rows.append(row)
        print(
            f"{name:45s} {rate:10.0f} {rate / base:6.2f} {row['bytes_pulled_per_sample']:9.1f} "
            f"{row['bytes_pushed_per_sample']:9.1f} {row['validation_auc']:8.4f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
