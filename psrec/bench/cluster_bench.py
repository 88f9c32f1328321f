"""psrec on a Ray cluster of three nodes on this machine, against the embedded single-node cluster.

Runs the quickstart model (DLRM, 1 trainer + 2 shards, sync) four ways and prints one table:

1. embedded: the embedded loopback cluster, data and run directory on local disk;
2. cluster + store: a 3-node cluster (`psrec.testing.local_cluster`: one `ray start` process group per node,
   all on 127.0.0.1), data and run directory on an S3-compatible store (moto's server, started here
   on 127.0.0.1);
3. node loss: as 2, and a worker node holding a shard is SIGKILLed (its raylet and every actor on
   it) halfway between two checkpoints: time from the kill to training again, steps recomputed;
4. pull/push within vs across nodes: the trainer pinned to node 0, both shards on node 0 or both on
   node 1 (custom node resources), local data: the trainer's pull and push seconds per step.

Usage (from the repository root; the nodes share this machine's cores, so the cluster figures
measure psrec's overheads, not more compute):

    python -m psrec.bench.cluster_bench [--rows 200000] [--every 40]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from psrec.bench import EXAMPLES
from psrec.cluster.start import token_path, write_private_token
from psrec.config import load_config
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.storage import StoragePath
from psrec.testing.local_cluster import LocalRayCluster
from psrec.train.data_sources import prepare_data
from psrec.train.loop import train
from psrec.train.runtime import RayRuntime

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_store(log: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """moto's S3 server in its own process on 127.0.0.1; the environment that points psrec at it."""
    port = _free_port()
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=output,
            stderr=output,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise TimeoutError("the moto server did not start within 30 s") from None
            time.sleep(0.2)
    return server, {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


def make_bucket(environment: dict[str, str]) -> str:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=environment["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket="psrec-bench")
    return "psrec-bench"


def write_data(root: Path, rows: int, scale: float) -> dict[str, Path]:
    splits = {}
    for split, count, seed in (("train", rows, 0), ("validation", rows // 8, 1)):
        write_synthetic_criteo(root / split, rows=count, seed=seed, cardinality_scale=scale)
        splits[split] = root / split
    return splits


def upload(splits: dict[str, Path], bucket: str) -> None:
    for split, directory in splits.items():
        for path in sorted(directory.glob("*.parquet")):
            StoragePath(f"s3://{bucket}/data/{split}/{path.name}").write_bytes(path.read_bytes())


def sources(prefix: str) -> dict[str, Any]:
    return {
        split: {"format": "parquet", "paths": [f"{prefix}/{split}/*.parquet"]}
        for split in ("train", "validation")
    }


def run(config_path: str, overrides: dict[str, Any], *, kill: Any = None) -> dict[str, Any]:
    config = load_config(config_path, overrides=overrides)
    data = prepare_data(config, base_dir=Path("."))
    runtime = RayRuntime(config, base_dir=".", data_sources=data)
    try:
        progress = (lambda report: kill(runtime, report)) if kill else None
        return train(config, runtime=runtime, progress=progress)
    finally:
        runtime.shutdown()


def row(name: str, summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    checkpoints = summary["checkpoints"]
    steps = max(1, summary["steps"])
    return {
        "run": name,
        "samples_per_s": round(summary["samples_per_second"]),
        "checkpoint_s": round(sorted(c["seconds"] for c in checkpoints)[len(checkpoints) // 2], 3)
        if checkpoints
        else None,
        "pull_ms_per_step": round(1000 * summary["phase_seconds"].get("pull", 0.0) / steps, 2),
        "push_ms_per_step": round(1000 * summary["phase_seconds"].get("push", 0.0) / steps, 2),
        "auc": round(summary["validation"]["auc"], 5),
        "shard_nodes": summary["placement"].get("shard_nodes"),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(EXAMPLES / "quickstart.yaml"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=40)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="psrec-cluster-") as tmp:
        root = Path(tmp)
        splits = write_data(root / "data", args.rows, scale=0.01)
        base = {
            "data.synthetic": None,
            "data.schema": criteo_schema().model_dump(),
            "checkpoint.every_steps": args.every,
            "training.log_every_steps": 10,
            "fault_tolerance.shard_failover": False,  # a lost node rolls the job back
        }
        local_data = {f"data.{split}": source for split, source in sources(str(root / "data")).items()}

        # 1. embedded cluster, local disk
        summary = run(args.config, {**base, **local_data, "run_dir": str(root / "embedded")})
        results.append(row("embedded, local disk", summary))

        store, environment = start_store(root / "moto.log")
        os.environ.update(environment)
        token = token_path() or root / "auth_token"  # the token the embedded run authenticated with
        write_private_token(token)
        cluster = LocalRayCluster(
            root / "cluster", nodes_wanted=3, cpus=2, units=8, environment=environment, token=token
        )
        try:
            bucket = make_bucket(environment)
            upload(splits, bucket)
            stored_data = {f"data.{split}": s for split, s in sources(f"s3://{bucket}/data").items()}
            cluster.start()
            os.environ.update(cluster.client_environment())
            joined = {**base, "ps.address": cluster.address}

            # 2. three nodes, data and run dir on the store
            summary = run(args.config, {**joined, **stored_data, "run_dir": f"s3://{bucket}/runs/cluster"})
            results.append(row("3 nodes, data + checkpoints on S3 (moto)", summary))

            # 3. node loss
            killed: dict[str, Any] = {}

            def kill_node(runtime: RayRuntime, report: dict[str, Any]) -> None:
                if killed or report["step"] < args.every * 3 // 2:
                    return
                node_of = _node_indexes()
                victim = next(
                    node_of[s["node_id"]] for s in runtime.placement["shards"] if node_of[s["node_id"]] != 0
                )
                killed.update(node=victim, at=time.time(), step=report["step"])
                cluster.kill_node(victim)

            summary = run(
                args.config,
                {**joined, **stored_data, "run_dir": f"s3://{bucket}/runs/node-loss"},
                kill=kill_node,
            )
            (recovery,) = summary["recoveries"]
            results.append(
                row(
                    "3 nodes, S3, a worker node killed",
                    summary,
                    kill_to_training_s=round(recovery["at"] + recovery["seconds"] - killed["at"], 1),
                    steps_recomputed=recovery["failed_at_step"] - recovery["restored_step"],
                    rows_exactly_once=summary["rows_consumed"] == summary["rows_consumed_unique"],
                )
            )

            # 4. pull/push within vs across nodes (node 0 and the worker node still alive)
            other = f"node{({1, 2} - {killed['node']}).pop()}"
            for where, shard_node in (
                ("within node 0", "node0"),
                (f"across nodes (0 -> {other[4:]})", other),
            ):
                summary = run(
                    args.config,
                    {
                        **joined,
                        **local_data,
                        "checkpoint.enabled": False,
                        "run_dir": str(root / f"pin-{shard_node}"),
                        "ps.placement.trainer_node_resource": "node0",
                        "ps.placement.shard_node_resource": shard_node,
                    },
                )
                results.append(row(f"trainer on node 0, shards {where}", summary))
        finally:
            import ray

            ray.shutdown()
            cluster.stop()
            store.kill()
    print(json.dumps(results, indent=1))
    columns = list(dict.fromkeys(key for result in results for key in result))
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(str(result.get(c, "")) for c in columns) + " |")


def _node_indexes() -> dict[str, int]:
    import ray

    indexes = {}
    for node in ray.nodes():
        names = [key for key in node["Resources"] if key.startswith("node") and key[4:].isdigit()]
        if names:
            indexes[node["NodeID"]] = int(names[0][4:])
    return indexes


if __name__ == "__main__":
    main()
