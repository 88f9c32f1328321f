"""`psrec serve` as a user runs it, in a process of its own: every socket of the serving run (the
driver, Ray's GCS, raylet and agents, Serve's controller, proxy and replica) listens on loopback only,
and SIGTERM ends the run cleanly (exit code 0) with every process it started gone by the time it
exits. One tiny DeepFM export, one replica; about 20 s on 2 cores.
"""

from __future__ import annotations

import importlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import is_loopback, listening_sockets

START_TIMEOUT_S = 180.0
# SIGTERM -> exit: Serve deletes the app (its replica gets Serve's graceful shutdown), Ray shuts
# down, and psrec ends what is left of the cluster's processes (psrec.cluster.start.stop_ray)
EXIT_TIMEOUT_S = 60.0


def _psutil() -> Any:
    import ray  # noqa: F401  - Ray ships psutil and puts it on sys.path

    return importlib.import_module("psutil")


@dataclass
class Serving:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def tree(self) -> list[Any]:
        """The driver and every process it started (GCS, raylet, agents, Serve's actors)."""
        driver = _psutil().Process(self.process.pid)
        return [driver, *driver.children(recursive=True)]

    def started(self) -> bool:
        """It answers, and `start_serving` has returned (it logs the URL last)."""
        logged = " serving " in self.log.read_text(errors="replace")
        return logged and _answers(f"http://127.0.0.1:{self.port}/version")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def serving(
    deepfm_run: dict[str, Any], exported: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Serving]:
    """`psrec serve MODEL_DIR --port P` on the DeepFM export, answering GET /version."""
    model = exported(deepfm_run["run_dir"])
    log = tmp_path_factory.mktemp("serve-cli") / "serve.log"
    port = _free_port()
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "psrec.cli", "serve", str(model), "--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    serving = Serving(process, port, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not serving.started():
            assert process.poll() is None, f"psrec serve exited ({process.returncode}):\n{serving.output()}"
            assert time.monotonic() < deadline, f"psrec serve did not answer:\n{serving.output()}"
            time.sleep(0.2)
        yield serving
    finally:
        if process.poll() is None:  # a failed test: end the run and whatever it started
            psutil = _psutil()
            tree = serving.tree()
            for member in tree:
                member.kill()
            psutil.wait_procs(tree, timeout=10)


def test_a_wildcard_grpc_address_becomes_loopback() -> None:
    from psrec.serve.deployment import loopback_address

    assert loopback_address("[::]:0") == "127.0.0.1:0"  # Serve's inter-deployment server
    assert loopback_address("0.0.0.0:9000") == "127.0.0.1:9000"
    assert loopback_address("10.0.0.5:9000") == "10.0.0.5:9000"
    assert loopback_address("[::1]:0") == "[::1]:0"


@pytest.mark.ray
def test_a_serving_run_listens_on_loopback_only(serving: Serving) -> None:
    tree = serving.tree()
    names = {member.pid: " ".join(member.cmdline()) for member in tree}
    replicas = [pid for pid, name in names.items() if name.startswith("ray::ServeReplica")]
    proxies = [pid for pid, name in names.items() if name.startswith("ray::ProxyActor")]
    assert len(replicas) == 1 and len(proxies) == 1, names
    sockets = listening_sockets(list(names))
    assert (proxies[0], "tcp", "127.0.0.1", serving.port) in sockets
    assert {pid for pid, *_ in sockets} >= {serving.process.pid, *replicas}
    outside = [(names[pid].split(" ")[0], *rest) for pid, *rest in sockets if not is_loopback(rest[1])]
    assert not outside, f"listening beyond loopback (process, protocol, address, port): {outside}"


@pytest.mark.ray
def test_sigterm_ends_a_serving_run_and_every_process_it_started(serving: Serving) -> None:
    psutil = _psutil()
    started = serving.tree()[1:]
    assert any(" ".join(member.cmdline()).startswith("ray::DashboardAgent") for member in started)
    signalled = time.monotonic()
    serving.process.send_signal(signal.SIGTERM)
    returncode = serving.process.wait(timeout=EXIT_TIMEOUT_S)
    print(f"psrec serve exited {time.monotonic() - signalled:.1f} s after SIGTERM")  # shown with -s
    assert returncode == 0, serving.output()
    alive = [member for member in started if member.is_running() and member.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after psrec serve exited: {alive}"
