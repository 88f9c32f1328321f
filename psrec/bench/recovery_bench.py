"""Recovery time after SIGKILL of a trainer or a PS shard, on the quickstart model (Ray, sync).

For each victim, trains with a checkpoint every `--every` steps, kills the victim's process once
halfway between two checkpoints, and reports the time from the kill to training again, the steps
rolled back, and that every row was still consumed exactly once. Usage:

    python -m psrec.bench.recovery_bench [--rows 200000] [--every 40]
"""

from __future__ import annotations

import argparse
import os
import signal
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(EXAMPLES / "quickstart.yaml"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=40)
    args = parser.parse_args()

    import ray

    start_ray(None, num_cpus=4)
    with tempfile.TemporaryDirectory() as tmp:
        for victim in ("trainer", "shard"):
            config = load_config(
                args.config,
                overrides={
                    "run_dir": f"{tmp}/{victim}",
                    "data.synthetic.train_rows": args.rows,
                    "checkpoint.every_steps": args.every,
                    "training.log_every_steps": 5,
                    "fault_tolerance.shard_failover": False,  # the whole-job rollback
                },
            )
            runtime = RayRuntime(config, base_dir=".", data_sources=prepare_data(config, base_dir=Path(".")))
            killed: dict[str, Any] = {}

            def kill(
                report: dict[str, Any],
                runtime: RayRuntime = runtime,
                victim: str = victim,
                killed: dict[str, Any] = killed,
            ) -> None:
                if not killed and report["step"] >= args.every * 3 // 2:
                    actor = runtime.trainers[0] if victim == "trainer" else runtime.shards[0]
                    pid = ray.get(actor.pid.remote())
                    killed.update(pid=pid, step=report["step"], at=time.time())
                    os.kill(pid, signal.SIGKILL)

            try:
                summary = train(config, runtime=runtime, progress=kill)
            finally:
                runtime.shutdown()
            recovery = summary["recoveries"][0]
            print(
                f"{victim}: killed at step {killed['step']}, rolled back to step {recovery['restored_step']}, "
                f"training again {recovery['at'] - killed['at']:.1f} s after the kill "
                f"(restore itself {recovery['seconds']:.1f} s); rows consumed {summary['rows_consumed']} "
                f"(unique {summary['rows_consumed_unique']} of {args.rows}); validation AUC "
                f"{summary['validation']['auc']:.4f}",
                flush=True,
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
