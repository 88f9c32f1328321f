"""Seconds to start the embedded Ray cluster and to have its actors up, in fresh processes.

Each round starts a new Python process that calls `start_ray(None)` as `psrec train` does (1 trainer
+ 2 shards: 3 actors, 2 CPUs), then creates three small actors and waits until every one has run
its `__init__`. Printed per way: seconds from the round's first line to `start_ray` returning and
to the last actor's `__init__`, medians over the rounds and each round. The ways, alternated round by
round:

- ``now``: `start_ray(None)` as it is;
- ``runtime-env``: the workers' settings (OpenMP wait policy, allocator) passed as a job
  `runtime_env` instead of through the raylet's environment;
- ``api-server``: Ray's API server process (`dashboard.py`) started as `ray.init` starts it.

Usage:

    python -m psrec.bench.ray_start_bench [--rounds 3] [--ways now,runtime-env,api-server]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

ROUND = textwrap.dedent(
    """
    import time

    started = time.time()  # the round's first line (the wall clock, as the actors' times)
    import contextlib, json, sys

    way = sys.argv[1]
    import ray

    from psrec.cluster import start as cluster

    if way == "api-server":
        cluster._without_api_server = contextlib.nullcontext
    if way == "runtime-env":
        init = ray.init
        settings = cluster._workers_environment(True)

        def with_runtime_env(*args, **kwargs):
            return init(*args, runtime_env={"env_vars": settings}, **kwargs)

        ray.init = with_runtime_env
    cluster.start_ray(None, num_cpus=2, actors=3, log_to_driver=False)
    up = time.time()

    @ray.remote(num_cpus=0.5)
    class Probe:
        def __init__(self):
            self.at = time.time()

        def at_init(self):
            return self.at

    probes = [Probe.remote() for _ in range(3)]
    actors = max(ray.get([probe.at_init.remote() for probe in probes]))
    ray.shutdown()
    print(json.dumps({"ray": up - started, "actors": actors - started}))
    """
)


def one_round(way: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", ROUND, way], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default="now,runtime-env,api-server")
    args = parser.parse_args()
    ways = args.ways.split(",")
    seconds: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            seconds[way].append(one_round(way))
    for way, rounds in seconds.items():
        for key in ("ray", "actors"):
            values = [r[key] for r in rounds]
            each = ", ".join(f"{v:.2f}" for v in values)
            print(f"{way:12s} {key:6s} {statistics.median(values):5.2f} s  ({each})")


if __name__ == "__main__":
    main()
