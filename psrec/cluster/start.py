"""Starting Ray: an embedded single-machine cluster bound to loopback, or joining an existing cluster.

`start_ray(None)` starts a local cluster whose every process (GCS, raylet and object manager, workers,
dashboard and runtime-env agents) listens on 127.0.0.1 only, never attaching to a cluster that
happens to run on the host; `start_ray("HOST:PORT")` joins the cluster there after checking that it
answers. Both use Ray's token authentication (`RAY_AUTH_MODE=token`, Ray >= 2.52): the embedded
cluster generates its token if there is none, and the token file is readable by its owner only
(0600); joining a cluster fails before connecting when no token is found. Every process Ray starts
gets the OpenMP wait policy and allocator settings of this process. What listens where is listed in
docs/fault_tolerance.md ("Network").

`stop_ray()` ends a run's Ray: `ray.shutdown()`, then every process of the embedded cluster that is
still running (an agent or worker whose raylet did not stop it) is ended, within a bound. Ray's
start leaves this process's SIGTERM handler as it was, so that a run stopped by SIGTERM gets to
that clean-up (`_sigterm_kept`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import re
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psrec.allocator import malloc_environment
from psrec.config import ConfigError, RunConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Token authentication (RAY_AUTH_MODE=token) first shipped in Ray 2.52.0.
MIN_RAY_VERSION = (2, 52)
# Ray's single-machine mode (its default on macOS and Windows): the node address stays loopback.
SINGLE_MACHINE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def required_cpus(config: RunConfig) -> float:
    ps = config.ps
    shards = 0 if ps.strategy == "collective" else ps.num_shards
    return ps.num_trainers * ps.trainer_resources.num_cpus + shards * ps.shard_resources.num_cpus


def ray_start_arguments(config: RunConfig) -> dict[str, Any]:
    """`start_ray`'s keyword arguments for `config`'s run (its address aside). The embedded cluster
    offers at least the CPUs the config asks for: logical CPUs are only scheduling tokens, and every
    process's thread count is set explicitly."""
    ps = config.ps
    return {
        "num_cpus": max(os.cpu_count() or 1, math.ceil(required_cpus(config))),
        "actors": ps.num_trainers + (0 if ps.strategy == "collective" else ps.num_shards),
    }


def start_ray_importing(config: RunConfig, module: str) -> bool:
    """Start (or join) the Ray cluster of `config`'s run while another thread imports `module`;
    True when this call started Ray (its caller then shuts it down), False when it was up already.

    `ray.init` runs on the main thread (it installs signal handlers there) and mostly waits for the
    processes it starts (GCS, raylet, agents); the driver's own imports run in the meantime instead
    of before (docs/benchmarks.md, "Start-up"). An import error is raised here, after Ray's start.
    """
    import ray

    if ray.is_initialized():
        importlib.import_module(module)
        return False
    failed: list[BaseException] = []

    def load() -> None:
        try:
            importlib.import_module(module)
        except BaseException as error:  # noqa: BLE001 - raised again on the main thread
            failed.append(error)

    loader = threading.Thread(target=load, name=f"import {module}", daemon=True)
    arguments = ray_start_arguments(config)
    prepared: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if config.ps.address is None:
        # The variables the embedded start sets are in place before the thread starts: glibc's
        # getenv (the imported libraries read their settings) is not safe beside a setenv that adds
        # a name; start_ray then only replaces values.
        enable_token_auth()
        prepared = environment_set(_embedded_environment(**arguments))
    with prepared:
        loader.start()
        try:
            start_ray(config.ps.address, **arguments)
        finally:
            loader.join()
    if failed:
        stop_ray()
        raise failed[0]
    return True


def start_ray(
    address: str | None,
    *,
    num_cpus: int | None = None,
    log_to_driver: bool = True,
    omp_passive: bool = True,
    actors: int | None = None,
) -> None:
    """Start an embedded loopback cluster (address None) or join `address`; clear error if unreachable
    or, for `address`, if no authentication token is found. omp_passive: the workers' OpenMP threads
    sleep when idle (OMP_WAIT_POLICY=PASSIVE unless this process sets it); False leaves OpenMP's own
    default (the benchmarks compare both).

    actors: the number of actors the run starts at once. The embedded cluster then starts them all
    together, and nothing else: by default Ray starts one idle worker process per CPU for the first
    driver, which actors do not use (each waits for a process of its own), and at most one worker
    process per CPU at a time, so that on 2 CPUs the trainer's process started only once a shard's
    was up (docs/benchmarks.md, "Start-up"). Variables already set in the environment win.

    A process already connected to Ray keeps its cluster: address None uses it, and an `address`
    naming another cluster is a ConfigError (a process joins one Ray cluster at a time).
    """
    import ray

    if ray.is_initialized():
        connected = ray.get_runtime_context().gcs_address
        if address is not None and not same_cluster(address, connected):
            raise ConfigError(
                f"ps.address {address!r}: this process is connected to the Ray cluster at {connected!r} "
                "already, and a process joins one cluster at a time. Run the job in a new process (or "
                "call ray.shutdown() first), or set ps.address to that cluster."
            )
        return
    check_ray_version(ray.__version__)
    if address is not None:
        check_reachable(address)
        check_token(address)
    else:
        enable_token_auth()
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": log_to_driver,
        "configure_logging": False,
    }
    try:
        if address is None:
            environment = _embedded_environment(num_cpus=num_cpus, actors=actors, omp_passive=omp_passive)
            with _loopback_node(), environment_set(environment), _without_api_server(), _sigterm_kept():
                ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, **kwargs)
            return
        kwargs["runtime_env"] = {"env_vars": _workers_environment(omp_passive)}
        # a cluster on this machine's loopback: Ray would swap 127.0.0.1 for a routable address
        node = _loopback_node() if _loopback_address(address) else contextlib.nullcontext()
        with node, _sigterm_kept():
            ray.init(address=address, **kwargs)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        where = "an embedded local cluster" if address is None else f"the Ray cluster at {address!r}"
        raise ConfigError(
            f"ps.address: could not start or join {where}: {error}. Check the address (ray status on the "
            "head node prints it) or leave ps.address empty to run on this machine."
        ) from None


def same_cluster(address: str, gcs_address: str) -> bool:
    """Whether `address` (HOST:PORT as ps.address takes it, or "auto") names the cluster whose GCS
    listens at `gcs_address` (IP:PORT): host names are resolved, "localhost" is the loopback."""
    if address == "auto":
        return True

    def endpoint(value: str) -> tuple[str, str]:
        host, _, port = value.rpartition(":")
        host = host.strip("[]")
        if host == "localhost":
            return LOOPBACK, port
        try:
            return socket.gethostbyname(host), port
        except OSError:
            return host, port

    return endpoint(address) == endpoint(gcs_address)


def _embedded_environment(
    *, num_cpus: int | None, actors: int | None, omp_passive: bool = True
) -> dict[str, str]:
    """The environment `start_ray(None)` starts the embedded cluster's processes with (the raylet,
    and through it every worker); Ray's settings already set in this process win.

    The workers inherit the raylet's environment: a job runtime_env would hold every worker's start
    until Ray's runtime-env agent is up (docs/benchmarks.md, "Start-up").
    """
    # Ray starts workers at nice 15; on a shared machine the trainer then starves.
    ray_settings = {"RAY_worker_niceness": "0"}
    if actors is not None:
        ray_settings |= _actor_start_settings(actors, num_cpus)
    return {
        **{name: os.environ.get(name, value) for name, value in ray_settings.items()},
        SINGLE_MACHINE_VARIABLE: "0",
        **_workers_environment(omp_passive),
    }


def _workers_environment(omp_passive: bool) -> dict[str, str]:
    # Actors share cores: OpenMP waiters must sleep, not spin (see psrec.cli.main).
    return {**_wait_policy(omp_passive), **malloc_environment()}


def _actor_start_settings(actors: int, num_cpus: int | None) -> dict[str, str]:
    """The raylet's settings that start `actors` worker processes at once and no idle ones."""
    return {
        "RAY_prestart_worker_first_driver": "0",
        "RAY_worker_maximum_startup_concurrency": str(max(actors, num_cpus or 1)),
    }


def _wait_policy(passive: bool) -> dict[str, str]:
    if "OMP_WAIT_POLICY" in os.environ:
        return {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    return {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}


def _loopback_address(address: str) -> bool:
    host = address.rpartition(":")[0]
    return host in (LOOPBACK, "localhost")


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Keep 127.0.0.1 as the node address while `ray.init` starts the cluster.

    Ray's servers (GCS, raylet and object manager, core workers) listen on 127.0.0.1 only when the
    node address is exactly "127.0.0.1", and on all interfaces otherwise; the dashboard and
    runtime-env agents bind to the node address. `ray.init` replaces a loopback `_node_ip_address`
    by the host's routable address unless Ray runs in its single-machine mode, which it reads from
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when a process imports it: the processes `ray.init` starts
    get the variable, this process (which imported Ray already) gets the constant set.
    """
    from ray._private import ray_constants

    previous_constant = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with environment_set({SINGLE_MACHINE_VARIABLE: "0"}):
            yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous_constant


@contextlib.contextmanager
def _without_api_server() -> Iterator[None]:
    """Start the embedded cluster without Ray's API server process.

    With the dashboard off, Ray's head still starts `dashboard.py` with only its usage-statistics
    module loaded, and `ray.init` waits for it to come up before it starts the raylet: 0.6-0.8 s
    on 2 cores (docs/benchmarks.md, "Start-up"). Nothing of it serves the embedded cluster (its
    web UI, state and job APIs are not loaded either way), so its start is skipped here, as Ray
    itself skips the web address on a minimal install: the node gets an empty dashboard address.
    """
    from ray._private import services

    start = getattr(services, "start_api_server", None)
    if start is None:  # another Ray layout: start what it starts
        yield
        return
    services.start_api_server = _no_api_server
    try:
        yield
    finally:
        services.start_api_server = start


def _no_api_server(*args: Any, **kwargs: Any) -> tuple[str, None]:
    return "", None  # (dashboard address, process): what Ray's start_api_server returns


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Leave this process's SIGTERM handling as it was across `ray.init`.

    `ray.init` replaces the SIGTERM handler (psrec's command line has its own: SIGTERM stops a run
    as Ctrl-C does) by one that calls `sys.exit`, and the driver's core worker then puts Ray's
    crash handler (absl's failure-signal handler) in front of it. That handler prints a stack,
    hands the signal on and arms a 3 s alarm that aborts the process (SIGABRT): a driver whose
    clean-up (Serve's app deleted, actors stopped, `ray.shutdown`) took longer died in the middle
    of it, and the cluster's agents then ran on for up to a minute. Installing the Python handler
    again (the one this process had, or Ray's when it had none) takes SIGTERM from the crash
    handler, which keeps the crash signals (SIGSEGV, SIGABRT, ...). Only the main thread sets
    handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        kept = before if before not in (signal.SIG_DFL, None) else signal.getsignal(signal.SIGTERM)
        if kept is not None:
            signal.signal(signal.SIGTERM, kept)


@contextlib.contextmanager
def environment_set(variables: dict[str, str]) -> Iterator[None]:
    """Set `variables` in this process's environment (so the processes it starts get them) and
    restore the earlier values afterwards."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_ray_version(version: str) -> None:
    """psrec needs Ray's token authentication (Ray >= 2.52)."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < MIN_RAY_VERSION:
        wanted = ".".join(map(str, MIN_RAY_VERSION))
        raise ConfigError(
            f"ray {version} has no token authentication: psrec needs ray>={wanted} "
            f"(pip install 'ray[default]>={wanted}')"
        )


# -- stopping ----------------------------------------------------------------------------------
# After ray.shutdown(): how long the embedded cluster's processes get to exit on their own, and
# then after SIGTERM, and after SIGKILL.
PROCESS_EXIT_TIMEOUT_S = 1.0


def stop_ray(*, timeout: float = PROCESS_EXIT_TIMEOUT_S) -> None:
    """Shut Ray down; when this process started the cluster (the embedded one), every process of
    it is gone when this returns (but for one stuck in the kernel, which is logged).

    `ray.shutdown()` stops the processes it started itself (GCS, raylet, monitors) and the raylet
    stops its own children (agents, workers) on its way out. When the raylet and the GCS die
    first (Ray kills a raylet that has not exited a second after SIGTERM, and stops the GCS right
    after), the dashboard and runtime-env agents run on for about a minute, trying to reach the
    GCS. The processes are listed before the shutdown (a raylet's children are its own only while
    it lives); those still running `timeout` seconds after it get SIGTERM, and `timeout` seconds
    later SIGKILL. A joined cluster's processes are not this process's to end: for it this is
    `ray.shutdown()`.
    """
    import ray

    processes = _embedded_cluster_processes()
    ray.shutdown()
    end_processes(processes, timeout=timeout)


def _embedded_cluster_processes() -> list[Any]:
    """The running processes of the cluster this process started (none for a joined cluster):
    those Ray started itself and all their descendants, as psutil processes."""
    from ray._private import worker

    psutil = _psutil()
    node = worker._global_node
    if psutil is None or node is None:
        return []
    processes = []
    for infos in node.all_processes.values():
        for info in infos:
            with contextlib.suppress(psutil.NoSuchProcess):  # one that exited since
                root = psutil.Process(info.process.pid)
                processes.extend([root, *root.children(recursive=True)])
    return processes


def end_processes(processes: list[Any], *, timeout: float = PROCESS_EXIT_TIMEOUT_S) -> list[Any]:
    """Give `processes` (psutil processes) `timeout` seconds to exit, then SIGTERM those left and
    as long again, then SIGKILL and as long again: at most 3 x `timeout` seconds. Returns those
    still running then (stuck in the kernel), logged as a warning; a zombie counts as exited."""
    alive = _running(processes, timeout)
    for signal_name in ("SIGTERM", "SIGKILL"):
        if not alive:
            return []
        described = ", ".join(_described(process) for process in alive)
        logger.info(
            "%s to %d processes of the Ray cluster left after its shutdown: %s",
            signal_name,
            len(alive),
            described,
        )
        for process in alive:
            with contextlib.suppress(Exception):  # it exited meanwhile
                process.send_signal(getattr(signal, signal_name))
        alive = _running(alive, timeout)
    if alive:
        described = ", ".join(_described(process) for process in alive)
        logger.warning("%d processes of the Ray cluster outlived SIGKILL: %s", len(alive), described)
    return alive


def _running(processes: list[Any], timeout: float) -> list[Any]:
    """Those of `processes` still running after at most `timeout` seconds of waiting for them."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [process for process in processes if _is_running(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _is_running(process: Any) -> bool:
    try:
        return bool(process.is_running() and process.status() != "zombie")
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess (and AccessDenied): not ours to wait for
        return False


def _described(process: Any) -> str:
    try:
        return f"{process.pid} ({process.name()})"
    except Exception:  # noqa: BLE001 - gone meanwhile: the pid says enough
        return str(process.pid)


def _psutil() -> Any:
    """psutil, which Ray ships (on sys.path once Ray is imported); None without it."""
    import ray  # noqa: F401

    try:
        return importlib.import_module("psutil")
    except ImportError:
        return None


# -- authentication ----------------------------------------------------------------------------
def token_path() -> Path | None:
    """The file Ray reads its token from (None when `RAY_AUTH_TOKEN` holds the token itself).

    Ray looks in `RAY_AUTH_TOKEN`, then the file `RAY_AUTH_TOKEN_PATH` names, then `~/.ray/auth_token`.
    """
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return None
    named = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    return Path(named) if named else Path.home() / ".ray" / "auth_token"


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def write_private_token(path: Path) -> None:
    """Make `path` hold a token readable by its owner only: write a new one (0600, in a 0700 directory
    when the directory is new) when the file is missing or empty, else tighten its mode to 0600."""
    if not _read_token(path):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(descriptor, 0o600)  # an existing empty file keeps its mode otherwise
            os.write(descriptor, secrets.token_hex(32).encode())  # 256 bits, as `ray get-auth-token`
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        logger.info("wrote a new Ray authentication token to %s (mode 0600)", path)
    restrict_token_file(path)


def restrict_token_file(path: Path) -> None:
    """Tighten the token file to 0600 (Ray writes it world-readable); warn when that is not possible."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return
    try:
        os.chmod(path, 0o600)
    except OSError as error:
        logger.warning("the Ray token %s is readable by others (mode %o) and stays so: %s", path, mode, error)
        return
    logger.warning("the Ray token %s was readable by others (mode %o): now 0600", path, mode)


def _set_token_mode() -> None:
    """Token authentication for this process and every process it starts."""
    raylet: Any = importlib.import_module("ray._raylet")  # its stub lacks the authentication names

    os.environ["RAY_AUTH_MODE"] = "token"
    if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        raylet.Config.initialize("")  # Ray read its configuration before the variable was set


def enable_token_auth() -> None:
    """The embedded cluster: token authentication, whatever `RAY_AUTH_MODE` says, with a private token."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        logger.warning(
            "RAY_AUTH_MODE=%s ignored: the embedded Ray cluster uses token authentication",
            os.environ["RAY_AUTH_MODE"],
        )
    _set_token_mode()
    path = token_path()
    if path is not None:
        write_private_token(path)


def check_token(address: str) -> None:
    """Before joining `address`: token authentication on and a token present, or a clear error.

    An explicit `RAY_AUTH_MODE=disabled` (a cluster started without authentication) is respected.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        logger.warning("RAY_AUTH_MODE=%s: joining %s without authentication", mode, address)
        return
    path = token_path()
    if path is not None and not _read_token(path):
        source = "RAY_AUTH_TOKEN_PATH" if os.environ.get("RAY_AUTH_TOKEN_PATH") else "the default path"
        raise ConfigError(
            f"ps.address {address!r}: no Ray authentication token (RAY_AUTH_TOKEN is not set and {path}, "
            f"{source}, is missing or empty). Print the cluster's token "
            "on its head node with `ray get-auth-token`, then store it in ~/.ray/auth_token (chmod 600) "
            "or in a file RAY_AUTH_TOKEN_PATH names, or set RAY_AUTH_TOKEN. A cluster started without "
            "authentication needs RAY_AUTH_MODE=disabled."
        )
    _set_token_mode()
    if path is not None:
        restrict_token_file(path)


def check_reachable(address: str, *, timeout: float = 5.0) -> None:
    """Fail fast on a Ray address that does not answer (ray.init itself retries for minutes)."""
    import socket

    if address in ("auto", "local") or "://" in address:
        return  # "auto" reads the local cluster file; client addresses are checked by ray.init
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"ps.address {address!r}: expected HOST:PORT of the Ray head node (e.g. 10.0.0.5:6379)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise ConfigError(
            f"ps.address {address!r} does not answer ({error}). Is the Ray head running there "
            "(`ray start --head` prints its address)? Leave ps.address empty to run on this machine."
        ) from None


# -- lost nodes --------------------------------------------------------------------------------
LOST_NODE_TIMEOUT_S = 90.0


def actor_state(actor: Any, *, timeout: float = 5.0) -> str:
    """ "alive", "dead" (Ray reports it died: its process, or its node marked dead), or "unreachable"
    (no answer yet: its node may be dying and not yet marked dead by the cluster's health checks)."""
    import ray
    from ray.exceptions import ActorDiedError, GetTimeoutError

    try:
        ray.get(actor.pid.remote(), timeout=timeout)
    except ActorDiedError:
        return "dead"
    except (GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return "unreachable"
    except Exception:  # noqa: BLE001 - any other failure: the actor must be replaced
        return "dead"
    return "alive"


def settle_lost_actors(actors: list[Any], *, timeout: float = LOST_NODE_TIMEOUT_S) -> list[str]:
    """Wait until every actor is alive or known dead, at most `timeout` seconds; their states.

    A node that dies takes a while (Ray's health checks: ~15-30 s) to be marked dead; until then
    its actors are unreachable rather than dead, and the scheduler may still place a replacement
    on it. Recovery waits here first, so that replacements go to the surviving nodes.
    """
    deadline = time.monotonic() + timeout
    states = [actor_state(actor) for actor in actors]
    while "unreachable" in states and time.monotonic() < deadline:
        logger.warning(
            "%d actors unreachable: waiting for the cluster to mark their node dead",
            states.count("unreachable"),
        )
        time.sleep(1.0)
        states = [
            state if state != "unreachable" else actor_state(actor)
            for actor, state in zip(actors, states, strict=True)
        ]
    return states
