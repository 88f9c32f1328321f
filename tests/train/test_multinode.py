"""psrec on a Ray cluster of three nodes (`psrec/testing/local_cluster.py`), with data and run directory on an
S3-compatible store (moto on 127.0.0.1): shards spread over the nodes, a whole node lost mid-run,
a shard killed, the driver killed and the run resumed from the store.

The oracle is the same run in process with nothing disturbed: in sync mode one Ray trainer steps
exactly as the in-process runtime does (`test_ray_single_trainer_sync_equals_in_process`), and a
restored run replays the same steps, so the final model must be that run's, row for row.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from psrec.storage import StorageError, StoragePath
from psrec.testing.local_cluster import LocalRayCluster
from psrec.train.loop import train
from tests.conftest import small_run_config
from tests.train.test_object_store_run import _upload

pytestmark = pytest.mark.ray

ROWS = 24_000
SETTINGS = {
    "ps.runtime": "ray",
    "ps.num_shards": 3,
    "checkpoint.every_steps": 20,
    "checkpoint.full_every": 2,
    "training.log_every_steps": 5,
    "fault_tolerance.shard_failover": False,  # node loss rolls the job back: what these tests check
}


@pytest.fixture(scope="module")
def cluster(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """Three nodes (head + 2 workers, 2 CPUs each) that reach the S3 server through their own
    environment; the test process joins them as the driver."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    from psrec.cluster.start import token_path, write_private_token

    root = tmp_path_factory.mktemp("cluster")
    token = token_path() or root / "auth_token"  # this process's token (see LocalRayCluster.token)
    write_private_token(token)
    nodes = LocalRayCluster(root, nodes_wanted=3, cpus=2, token=token)
    nodes.environment = s3_server.environment()
    nodes.start()
    try:
        with _environment(nodes.client_environment()):
            yield nodes
    finally:
        ray.shutdown()
        nodes.stop()


@pytest.fixture(scope="module")
def stored_sources(s3_server: Any, synthetic_sources: dict[str, Any]) -> dict[str, Any]:
    with _environment(s3_server.environment()):
        return _upload(synthetic_sources, s3_server.create_bucket())


@pytest.fixture(scope="module")
def oracle(stored_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Any:
    """The undisturbed run, in process (same data on the store, a local run directory)."""
    from psrec.train.runtime import LocalRuntime

    config = small_run_config(
        stored_sources, tmp_path_factory.mktemp("oracle"), **{**SETTINGS, "ps.runtime": "local"}
    )
    with _environment(s3_server.environment()):
        runtime = LocalRuntime(config, base_dir=".", data_sources=stored_sources)
        try:
            summary = train(config, runtime=runtime)
            return summary, runtime.dense_states()[0], runtime.table_rows()
        finally:
            runtime.shutdown()


class _environment:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        self.saved = {name: os.environ.get(name) for name in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _node_indexes() -> dict[str, int]:
    """Ray node id -> index of the cluster's node (its custom resource node<i>)."""
    import ray

    indexes = {}
    for node in ray.nodes():
        (name,) = [key for key in node["Resources"] if key.startswith("node") and key[4:].isdigit()]
        indexes[node["NodeID"]] = int(name[4:])
    return indexes


def _assert_oracle_model(
    summary: dict[str, Any], dense: dict[str, Any], rows: dict[str, Any], oracle: Any
) -> None:
    expected_summary, expected_dense, expected_rows = oracle
    assert summary["steps"] == expected_summary["steps"]
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    for metric in ("auc", "logloss"):
        assert summary["validation"][metric] == expected_summary["validation"][metric]
    for name, value in expected_dense.items():
        torch.testing.assert_close(dense[name], value, rtol=0, atol=0, msg=name)
    for table, (ids, values) in expected_rows.items():
        np.testing.assert_array_equal(rows[table][0], ids, err_msg=table)
        np.testing.assert_allclose(rows[table][1], values, rtol=0, atol=0, err_msg=table)


def test_a_lost_node_is_replaced_from_the_object_store_with_the_undisturbed_model(
    cluster: LocalRayCluster, stored_sources: dict[str, Any], oracle: Any, s3_server: Any
) -> None:
    """Shards spread over the three nodes; SIGKILL of a whole worker node (raylet, shard and any
    trainer on it) after a checkpoint: the lost actors start on the surviving nodes, read
    the checkpoint from the store, and the run ends with the undisturbed model, every row once."""
    from psrec.train.runtime import RayRuntime

    bucket = stored_sources["train"]["paths"][0].split("/")[2]
    run_dir = f"s3://{bucket}/runs/node-loss"
    config = small_run_config(stored_sources, run_dir, **{**SETTINGS, "ps.address": cluster.address})
    with _environment(s3_server.environment()):
        runtime = RayRuntime(config, base_dir=".", data_sources=stored_sources)
        first_placement = runtime.placement
        node_index = _node_indexes()
        assert first_placement["nodes_alive"] == 3
        assert first_placement["shard_nodes"] == 3, first_placement  # spread: one shard per node
        victim = next(
            node_index[shard["node_id"]]
            for shard in first_placement["shards"]
            if node_index[shard["node_id"]] != 0  # not the head: it holds the cluster's GCS
        )
        killed: list[float] = []
        # The node's actor processes: a worker may outlive its node's process group for a while
        # (seen once: the rest of the epoch ran on it), so they are killed with it and waited for.
        victim_pids = [
            int(actor["pid"])
            for actor in [*first_placement["shards"], *first_placement.get("trainers", [])]
            if node_index[actor["node_id"]] == victim
        ]

        def kill_node(report: dict[str, Any]) -> None:
            if report["step"] >= 35 and not killed:  # after the step-20 checkpoint
                cluster.kill_node(victim)
                _kill_and_wait(victim_pids)
                killed.append(time.time())

        try:
            summary = train(config, runtime=runtime, progress=kill_node)
            dense, rows = runtime.dense_states()[0], runtime.table_rows()
        finally:
            runtime.shutdown()
    assert killed, "the node was never killed"
    (recovery,) = summary["recoveries"]
    # from a periodic checkpoint, or from the epoch end's when the loss is noticed right after it
    restored, failed = recovery["restored_step"], recovery["failed_at_step"]
    assert (restored % 20 == 0 and restored <= failed) or restored == failed, recovery
    placement = summary["placement"]
    assert placement["nodes_alive"] == 2
    assert victim not in {node_index[a["node_id"]] for a in [*placement["shards"], *placement["trainers"]]}
    _assert_oracle_model(summary, dense, rows, oracle)
    with _environment(s3_server.environment()):
        stored = json.loads(StoragePath(f"{run_dir}/summary.json").read_bytes())  # written to the store
    assert stored["recoveries"] == summary["recoveries"]


@pytest.mark.slow
def test_a_killed_driver_resumes_from_the_object_store(
    cluster: LocalRayCluster, stored_sources: dict[str, Any], oracle: Any, s3_server: Any, tmp_path: Path
) -> None:
    """`psrec train --address` killed with SIGKILL once a checkpoint is committed on the store (its
    actors die with it); the same command again resumes there and ends with the undisturbed model's
    validation."""
    bucket = stored_sources["train"]["paths"][0].split("/")[2]
    run_dir = f"s3://{bucket}/runs/driver-killed"
    config = small_run_config(stored_sources, run_dir, **SETTINGS)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", by_alias=True)))
    environment = {**os.environ, **s3_server.environment(), **cluster.client_environment()}
    psrec = str(Path(sys.executable).parent / "psrec")
    command = [psrec, "train", str(path), "--address", cluster.address, "--no-progress"]
    with (tmp_path / "first.log").open("wb") as log:
        driver = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        checkpoints = StoragePath(f"{run_dir}/checkpoints")
        deadline = time.monotonic() + 240
        with _environment(s3_server.environment()):
            while not any("ckpt-000000020" in name for name in _names(checkpoints)):
                assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no step-20 checkpoint within 240 s"
                time.sleep(0.5)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with _environment(s3_server.environment()):
        summary = json.loads(StoragePath(f"{run_dir}/summary.json").read_bytes())
    assert summary["resumed_from"] is not None
    expected = oracle[0]
    assert summary["steps"] == expected["steps"]
    assert summary["validation"]["auc"] == expected["validation"]["auc"]


def _names(directory: StoragePath) -> list[str]:
    try:
        return [entry.name for entry in directory.iterdir()]
    except (FileNotFoundError, OSError, StorageError):
        return []


def _kill_and_wait(pids: list[int], timeout_s: float = 30.0) -> None:
    """SIGKILL `pids` (those still running) and wait, bounded, until none is left."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.05)
