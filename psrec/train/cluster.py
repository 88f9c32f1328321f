"""Starting Ray: an embedded single-machine cluster bound to loopback, or joining an existing cluster.

`start_ray(None)` starts a local cluster on 127.0.0.1 only (never attaching to a cluster that happens
to run on the host); `start_ray("HOST:PORT")` joins the cluster there after checking that it answers.
Every process Ray starts gets the OpenMP wait policy and allocator settings of this process.
"""

from __future__ import annotations

import os
from typing import Any

from psrec.allocator import malloc_environment
from psrec.config import ConfigError, RunConfig


def required_cpus(config: RunConfig) -> float:
    ps = config.ps
    shards = 0 if ps.strategy == "collective" else ps.num_shards
    return ps.num_trainers * ps.trainer_resources.num_cpus + shards * ps.shard_resources.num_cpus


def start_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Start an embedded loopback cluster (address None) or join `address`; clear error if unreachable."""
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        check_reachable(address)
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
        # Actors share cores: OpenMP waiters must sleep, not spin (see psrec.cli.main).
        "runtime_env": {
            "env_vars": {
                "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                **malloc_environment(),
            }
        },
    }
    try:
        if address is None:
            # Ray starts workers at nice 15; on a shared machine the trainer then starves.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        where = "an embedded local cluster" if address is None else f"the Ray cluster at {address!r}"
        raise ConfigError(
            f"ps.address: could not start or join {where}: {error}. Check the address (ray status on the "
            "head node prints it) or leave ps.address empty to run on this machine."
        ) from None


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
