"""Starting or joining Ray: the embedded cluster listens on loopback only and authenticates with a
private token; joining a cluster without a token fails before connecting.

The tests without Ray come first: the module's Ray cluster (`ray_cluster`) stays up from the first
test that asks for it to the end of the module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from psrec.cluster import start as cluster
from psrec.config import ConfigError
from tests.conftest import is_loopback, listening_sockets, small_run_config

AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture
def no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without ~/.ray and no RAY_AUTH_* variables; restored afterwards, whatever the code sets."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in AUTH_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return home


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ray_without_token_authentication_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ray>=2\.52"):
        cluster.check_ray_version("2.51.1")
    for version in ("2.52.0", "2.60.0", "3.0.0.dev0"):
        cluster.check_ray_version(version)


def test_token_file_is_private(no_token: Path) -> None:
    path = cluster.token_path()
    assert path == no_token / ".ray" / "auth_token"
    cluster.write_private_token(path)
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    cluster.write_private_token(path)
    assert path.read_text() == token  # an existing token is kept

    path.chmod(0o644)  # as Ray writes it
    cluster.write_private_token(path)
    assert _mode(path) == 0o600 and path.read_text() == token

    path.write_text("")
    path.chmod(0o644)
    cluster.write_private_token(path)  # an empty file gets a token, and is private before it does
    assert _mode(path) == 0o600 and len(path.read_text()) == 64


def test_joining_without_a_token_fails_before_connecting(
    no_token: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    import ray

    assert not ray.is_initialized()
    with socket.socket() as head:  # answers the reachability check; Ray would wait for minutes
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"127.0.0.1:{head.getsockname()[1]}"
        with pytest.raises(ConfigError, match="no Ray authentication token.*ray get-auth-token"):
            cluster.start_ray(address)
        assert not ray.is_initialized()

        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(no_token / "missing"))
        with pytest.raises(ConfigError, match="missing.*RAY_AUTH_TOKEN_PATH"):
            cluster.start_ray(address)

    token = no_token / "token"
    token.write_text("abc\n")
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    cluster.check_token(address)
    assert os.environ["RAY_AUTH_MODE"] == "token" and _mode(token) == 0o600

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster without authentication, said explicitly
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    cluster.check_token(address)


def _run_fresh(script: str, env: dict[str, str], cwd: Path) -> tuple[dict[str, str], str]:
    """Run `script` in a fresh Python process; its "NAME VALUE" lines as a dict, and its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line), done.stdout


def test_the_embedded_start_sets_its_variables_before_the_import_thread_starts(
    no_token: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`start_ray_importing` on the embedded cluster: the module imported beside Ray's start finds
    every variable the start sets already in place (a setenv adding a name beside the libraries'
    getenv is not thread-safe), and this process's environment is as before afterwards."""
    from psrec.config import load_config

    names = ["RAY_worker_niceness", "RAY_worker_maximum_startup_concurrency", "OMP_WAIT_POLICY"]
    for name in [*names, cluster.SINGLE_MACHINE_VARIABLE]:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "psrec_env_probe.py").write_text("import os\nSEEN = dict(os.environ)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started: list[dict[str, str]] = []
    monkeypatch.setattr(cluster, "start_ray", lambda *args, **kwargs: started.append(dict(os.environ)))
    config = load_config(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
    try:
        assert cluster.start_ray_importing(config, "psrec_env_probe")
        seen = sys.modules["psrec_env_probe"].SEEN
    finally:
        sys.modules.pop("psrec_env_probe", None)
    assert {name: seen.get(name) for name in names} == {
        "RAY_worker_niceness": "0",
        "RAY_worker_maximum_startup_concurrency": str(max(3, os.cpu_count() or 1)),  # 1 + 2 actors
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert seen[cluster.SINGLE_MACHINE_VARIABLE] == "0" and seen["RAY_AUTH_MODE"] == "token"
    assert started and started[0][cluster.SINGLE_MACHINE_VARIABLE] == "0"
    assert not any(name in os.environ for name in [*names, cluster.SINGLE_MACHINE_VARIABLE])


def test_processes_left_after_a_shutdown_are_ended_within_the_bound() -> None:
    """`end_processes`: one process that exits by itself, one that exits on SIGTERM, one that
    ignores SIGTERM; all three are gone within 3 x the timeout."""
    import importlib

    import ray  # noqa: F401  - Ray ships psutil and puts it on sys.path

    psutil = importlib.import_module("psutil")
    ignores = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    scripts = ["import time; time.sleep(0.1)", "import time; print(1, flush=True); time.sleep(60)", ignores]
    children = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) for script in scripts
    ]
    for child in children[1:]:
        assert child.stdout is not None and child.stdout.readline()  # its handler is in place
    processes = [psutil.Process(child.pid) for child in children]
    started = time.monotonic()
    try:
        assert cluster.end_processes(processes, timeout=0.5) == []
        assert time.monotonic() - started < 3 * 0.5 + 1.0
        returncodes = [child.wait(timeout=5) for child in children]
        assert returncodes == [0, -signal.SIGTERM, -signal.SIGKILL]
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.ray
def test_embedded_cluster_authenticates_with_a_private_token(tmp_path: Path) -> None:
    """In a fresh process (Ray caches the token it read): RAY_AUTH_MODE=disabled in the environment and
    no token yet; the embedded cluster still runs with token authentication and a 0600 token."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    env |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    script = textwrap.dedent(
        """
        import os, stat
        import ray
        from ray._raylet import AuthenticationMode, get_authentication_mode
        from psrec.cluster.start import start_ray

        start_ray(None, num_cpus=1, log_to_driver=False)
        try:
            token = os.path.expanduser("~/.ray/auth_token")
            print("mode", get_authentication_mode() == AuthenticationMode.TOKEN)
            print("file", oct(stat.S_IMODE(os.stat(token).st_mode)))
            print("worker", ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).remote()))
        finally:
            ray.shutdown()
        """
    )
    lines, stdout = _run_fresh(script, env, tmp_path)
    assert lines == {"mode": "True", "file": "0o600", "worker": "token"}, stdout


@pytest.mark.ray
def test_embedded_cluster_starts_lean_and_its_workers_inherit_the_settings(tmp_path: Path) -> None:
    """In a fresh process whose environment has neither variable: every worker gets the OpenMP wait
    policy and the allocator settings, the job has no runtime_env (which would hold each worker's
    start until Ray's runtime-env agent is up), the driver's own environment is as before, and no
    API server process (`dashboard.py`, which `ray.init` waits for) was started."""
    names = ("OMP_WAIT_POLICY", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "PSREC_MALLOC_TUNING")
    env = {name: value for name, value in os.environ.items() if name not in names}
    script = textwrap.dedent(
        """
        import os
        import ray
        from psrec.allocator import SETTINGS
        from psrec.cluster.start import start_ray

        start_ray(None, num_cpus=1, log_to_driver=False)
        try:
            names = ["OMP_WAIT_POLICY", *SETTINGS]
            print("worker", ray.get(ray.remote(lambda: [os.environ.get(n) for n in names]).remote()))
            print("driver", [os.environ.get(n) for n in names])
            print("runtime_env", dict(ray.get_runtime_context().runtime_env))
            import psutil
            commands = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
            print("api_server", any("dashboard/dashboard.py" in c for c in commands))
            print("raylet", any("raylet" in c for c in commands))
        finally:
            ray.shutdown()
        """
    )
    lines, stdout = _run_fresh(script, env, tmp_path)
    assert lines == {
        "worker": str(["PASSIVE", str(32 << 20), str(1 << 30)]),
        "driver": str([None, None, None]),
        "runtime_env": "{}",
        "api_server": "False",
        "raylet": "True",
    }, stdout


@pytest.mark.ray
def test_stopping_the_embedded_cluster_ends_what_a_killed_raylet_and_gcs_left(tmp_path: Path) -> None:
    """In a fresh process: as `ray.shutdown()` comes to stop the cluster's processes, the raylet
    and the GCS are SIGKILLed (as when Ray kills a raylet that did not exit within its second and
    stops the GCS right after). Their dashboard and runtime-env agents and an idle worker, left
    without both, would run on for about a minute; `stop_ray` ends them within its bound."""
    script = textwrap.dedent(
        """
        import time
        import ray
        import psutil  # Ray ships it and puts it on sys.path
        from ray._private import worker
        from psrec.cluster.start import start_ray, stop_ray

        start_ray(None, num_cpus=1, log_to_driver=False)
        ray.get(ray.remote(lambda: 0).remote())  # a worker process
        started = psutil.Process().children(recursive=True)
        names = sorted(" ".join(p.cmdline()).split(" ")[0].split("/")[-1] for p in started)
        node = worker._global_node
        killed = [node.all_processes[name][0].process for name in ("raylet", "gcs_server")]
        kill_all_processes = node.kill_all_processes
        shut_down = []

        def killed_first(*args, **kwargs):
            for process in killed:
                process.kill()
                process.wait()
            kill_all_processes(*args, **kwargs)
            shut_down.append(time.monotonic())

        node.kill_all_processes = killed_first
        stop_ray(timeout=1.0)
        print("seconds", round(time.monotonic() - shut_down[0], 1))  # after Ray's own shutdown
        print("started", names)
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        print("alive", [p.pid for p in alive])
        """
    )
    lines, stdout = _run_fresh(script, dict(os.environ), tmp_path)
    assert "ray::DashboardAgent" in lines["started"] and "ray::RuntimeEnvAgent" in lines["started"], stdout
    assert lines["alive"] == "[]", stdout
    assert float(lines["seconds"]) < 3 * 1.0 + 1.0, stdout


def _job_pids() -> list[int]:
    """This driver and every process it started (GCS, raylet, agents, workers: all its descendants)."""
    import importlib

    psutil = importlib.import_module("psutil")  # Ray's, on sys.path since the cluster started
    driver = psutil.Process()
    return [driver.pid, *(child.pid for child in driver.children(recursive=True))]


@pytest.mark.ray
def test_embedded_job_listens_on_loopback_only(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    import ray

    from psrec.train.runtime import RayRuntime

    config = small_run_config(
        synthetic_sources, tmp_path / "run", **{"ps.runtime": "ray", "ps.num_trainers": 2}
    )
    runtime = RayRuntime(config, base_dir=str(tmp_path), data_sources=synthetic_sources)
    try:
        actors = ray.get([a.pid.remote() for a in [*runtime.trainers, *runtime.shards]])
        pids = _job_pids()
        assert set(actors) <= set(pids)
        sockets = listening_sockets(pids)
        assert {pid for pid, *_ in sockets} >= set(actors)  # every actor serves (its core worker)
        outside = [s for s in sockets if not is_loopback(s[2])]
        assert not outside, f"listening beyond loopback (pid, protocol, address, port): {outside}"
    finally:
        runtime.shutdown()


@pytest.mark.ray
def test_sigterm_ends_an_embedded_training_run_and_every_process_it_started(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """`psrec train` on the embedded cluster, SIGTERMed while it trains: psrec's own clean-up runs to
    its end (exit code 130, as for Ctrl-C) and every process the run started (GCS, raylet, agents,
    trainer and shards) is gone by the time the command exits."""
    import importlib

    import ray  # noqa: F401  - Ray ships psutil and puts it on sys.path

    psutil = importlib.import_module("psutil")
    config = small_run_config(
        synthetic_sources, tmp_path / "run", **{"ps.runtime": "ray", "training.epochs": 50}
    )
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json")))  # YAML reads JSON
    log = tmp_path / "train.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "psrec.cli", "train", str(path), "--no-progress"],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while " step 10 " not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        started = psutil.Process(process.pid).children(recursive=True)
        assert any(" ".join(member.cmdline()).startswith("ray::DashboardAgent") for member in started)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
        print(f"psrec train exited {time.monotonic() - signalled:.1f} s after SIGTERM")  # shown with -s
        assert returncode == 130, log.read_text()[-4000:]
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"still running after psrec train exited: {alive}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.ray
def test_trainers_asking_for_more_gpus_than_the_cluster_has_are_refused(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    import ray

    from psrec.train.runtime import RayRuntime

    trainers = int(ray.cluster_resources().get("GPU", 0.0)) + 1
    config = small_run_config(
        synthetic_sources,
        tmp_path / "run",
        **{
            "ps.runtime": "ray",
            "ps.num_trainers": trainers,
            "ps.trainer_resources": {"num_cpus": 0.5, "num_gpus": 1},
            "training.device": "cuda",
        },
    )
    with pytest.raises(ConfigError, match=rf"{trainers} trainers x 1.0 GPU = {trainers}.0 GPUs, but the Ray"):
        RayRuntime(config, base_dir=str(tmp_path), data_sources=synthetic_sources)


def test_an_address_names_the_cluster_whose_gcs_listens_there() -> None:
    from psrec.cluster.start import same_cluster

    assert same_cluster("127.0.0.1:6379", "127.0.0.1:6379")
    assert same_cluster("localhost:6379", "127.0.0.1:6379")
    assert same_cluster("auto", "10.0.0.5:6379")
    assert not same_cluster("127.0.0.1:6380", "127.0.0.1:6379")
    assert not same_cluster("10.0.0.6:6379", "10.0.0.5:6379")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_a_process_connected_to_one_cluster_refuses_an_address_of_another() -> None:
    """train() twice in one process with different ps.address values: the second is a ConfigError
    naming both clusters, not a silent run on the first; its own address or none keeps it."""
    import ray

    from psrec.cluster.start import start_ray

    connected = ray.get_runtime_context().gcs_address
    host, _, port = connected.rpartition(":")
    other = f"{host}:{int(port) + 1}"
    with pytest.raises(ConfigError, match=re.escape(other) + ".*" + re.escape(connected)):
        start_ray(other)
    start_ray(connected)
    start_ray(None)
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == connected


def test_the_embedded_cluster_starts_every_actor_at_once_and_no_idle_worker() -> None:
    settings = cluster._actor_start_settings(3, num_cpus=2)
    assert settings == {
        "RAY_prestart_worker_first_driver": "0",
        "RAY_worker_maximum_startup_concurrency": str(max(3, os.cpu_count() or 1)),  # 1 + 2 actors
    }
    assert cluster._actor_start_settings(1, num_cpus=4)["RAY_worker_maximum_startup_concurrency"] == "4"


def test_ray_start_arguments_count_the_runs_actors() -> None:
    from psrec.config import load_config

    quickstart = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
    arguments = cluster.ray_start_arguments(load_config(quickstart))  # 1 trainer + 2 shards
    assert arguments["actors"] == 3 and arguments["num_cpus"] >= 2
    collective = load_config(quickstart, overrides={"ps.strategy": "collective"})
    assert cluster.ray_start_arguments(collective)["actors"] == 1  # no shard actors
