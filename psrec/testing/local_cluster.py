"""A Ray cluster of several nodes on this machine, for the multi-node tests and benchmarks.

Each node is its own `ray start --block` process group (GCS and raylet on the head; raylet, agents
and workers on every node) listening on 127.0.0.1 only (the nodes are told apart by node id and by a
custom resource ``node<i>``), with its own scratch directory as the working directory of everything it starts: a file
a node's actor writes to a relative path stays on that node. Killing a node's process group with
SIGKILL is a whole node dying (its raylet and every actor on it). Token authentication is on with
a private token file; every port is chosen free on its node's address. Starts and stops are
bounded in time; `stop` kills whatever is left.

Every node can also offer the same custom resources (`resources`): with ``{"psrec_shard": 1}`` on
each node and ``ps.placement.shard_node_resource: psrec_shard``, a run puts one shard on each node.
All nodes share this machine's cores, memory and loopback interface: the cluster shows what crossing
nodes costs psrec (Ray's object transfer between raylets), not more compute.

    cluster = LocalRayCluster(Path("/tmp/c"), nodes_wanted=2, cpus=2, token=path).start()
    os.environ.update(cluster.client_environment())  # then ps.address: cluster.address
    ...
    cluster.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_START_TIMEOUT_S = 90.0
LOOPBACK = "127.0.0.1"
# `ray start` as its command line runs it, except that the node address 127.0.0.1 is kept: Ray's
# servers listen on loopback only when the node address is exactly 127.0.0.1, and `ray start`
# replaces it by the host's routable address on a machine that may join other nodes.
KEEP_LOOPBACK = (
    "import sys; import ray._private.services as services; "
    "services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)
NODE_STOP_TIMEOUT_S = 20.0
# `ray start --block` stops its node's processes on SIGTERM, but may take many seconds: a test cluster
# needs no graceful end, so what is not gone by then is SIGKILLed with its process group.
NODE_STOP_GRACE_S = 3.0


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@dataclass
class Node:
    index: int
    address: str  # the node's IP
    scratch: Path
    process: subprocess.Popen[bytes]
    log: Path
    alive: bool = True

    @property
    def head(self) -> bool:
        return self.index == 0


@dataclass
class LocalRayCluster:
    """`nodes` Ray nodes (the first is the head) with `cpus` logical CPUs each, under `root`."""

    root: Path
    nodes_wanted: int = 3
    cpus: int = 2
    units: int = 1  # of the custom resource node<i> each node offers
    resources: dict[str, float] = field(default_factory=dict)  # more custom resources, on every node
    environment: dict[str, str] = field(default_factory=dict)  # given to every node (e.g. S3 endpoint)
    nodes: list[Node] = field(default_factory=list)
    port: int = 0

    @property
    def address(self) -> str:
        return f"{self.nodes[0].address}:{self.port}"

    # the token file every node and the driver read; None: a fresh one under root. A process keeps
    # the first token it authenticated with, so a test process that also starts embedded clusters
    # passes its own (`psrec.cluster.start.token_path()`).
    token: Path | None = None

    @property
    def token_path(self) -> Path:
        return self.token if self.token is not None else self.root / "auth_token"

    def client_environment(self) -> dict[str, str]:
        """What a driver needs to join: token authentication and the token file."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def start(self) -> LocalRayCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.token is None:
            descriptor = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as token:
                token.write(secrets.token_hex(32))
        try:
            for index in range(self.nodes_wanted):
                try:
                    self._start_node(index)
                except RuntimeError:  # a node that timed out talking to the GCS on a loaded machine
                    self.nodes.pop()
                    self._start_node(index)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, index: int) -> None:
        address = LOOPBACK
        scratch = self.root / f"node{index}"
        scratch.mkdir(parents=True, exist_ok=True)
        ports = {
            "--node-manager-port": free_port(address),
            "--object-manager-port": free_port(address),
            "--dashboard-agent-listen-port": free_port(address),
            "--dashboard-agent-grpc-port": free_port(address),
            "--metrics-export-port": free_port(address),
            "--runtime-env-agent-port": free_port(address),
        }
        command = [
            sys.executable,
            "-c",
            KEEP_LOOPBACK,
            "start",
            "--block",
            f"--node-ip-address={address}",
            f"--num-cpus={self.cpus}",
            f"--resources={json.dumps({f'node{index}': self.units, **self.resources})}",
            "--disable-usage-stats",
            *[f"{flag}={port}" for flag, port in ports.items()],
        ]
        if index == 0:
            self.port = free_port(address)
            command += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port(address)}",
                f"--dashboard-port={free_port('127.0.0.1')}",
            ]
        else:
            command.append(f"--address={self.address}")
        environment = {
            **os.environ,
            **self.environment,
            **self.client_environment(),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_worker_niceness": "0",
        }
        log = self.root / f"node{index}.log"
        with log.open("wb") as output:
            process = subprocess.Popen(
                command,
                cwd=scratch,
                env=environment,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node = Node(index, address, scratch, process, log)
        self.nodes.append(node)
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while b"Ray runtime started" not in log.read_bytes():
            if process.poll() is not None:
                raise RuntimeError(
                    f"ray node {index} exited with {process.returncode}:\n{log.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray node {index} did not start within {NODE_START_TIMEOUT_S} s")
            time.sleep(0.2)

    def kill_node(self, index: int) -> None:
        """SIGKILL every process of node `index` at once (a node lost with everything on it)."""
        node = self.nodes[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait(timeout=NODE_STOP_TIMEOUT_S)
        node.alive = False

    def stop(self) -> None:
        """Stop every node, workers first; SIGKILL what does not exit in time."""
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + NODE_STOP_GRACE_S
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)  # the group's other processes too
            node.alive = False
