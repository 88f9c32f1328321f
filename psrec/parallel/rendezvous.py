"""Joining a torch.distributed process group that listens on one address, never on all interfaces.

`torch.distributed.init_process_group` with `MASTER_ADDR` / `tcp://HOST:PORT` has rank 0 start a
TCPStore server on every interface (the address only tells the other ranks where to connect), and
gloo listens on the address the host name resolves to. Neither authenticates. Here rank 0 binds the
store's socket itself, on the given address, and hands it to the TCPStore (`master_listen_fd`), and
every rank's gloo device sits on the interface that holds its own address: loopback for a
single-machine group, the node's address on a cluster::

    listener = listen("127.0.0.1")          # rank 0, before the port is handed out (no port race)
    port = listener.getsockname()[1]
    init_process_group("gloo", master_address="127.0.0.1", master_port=port, rank=rank,
                       world_size=2, local_address="127.0.0.1",
                       listen_fd=listener.detach() if rank == 0 else None)

Trainers whose dense model is on a GPU join with ``backend_for("cuda")``: GPU tensors are reduced by
NCCL, CPU ones (the trainers' step agreement, the collective strategy's exchanges) still by gloo;
NCCL's own sockets go on the same interface as gloo's.

Used by the Ray trainers (`psrec.trainer.worker`) and the multi-process helper (`psrec.parallel.launch`).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from typing import Any

logger = logging.getLogger(__name__)


def listen(address: str) -> socket.socket:
    """A TCP socket bound to (`address`, a free port) and listening: the store's, for rank 0."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def _psutil() -> Any:
    try:
        import psutil  # Ray ships it (on sys.path once Ray is imported)
    except ImportError:
        return None
    return psutil


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (gloo picks an interface, not an address), or None."""
    psutil = _psutil()
    if psutil is not None:
        for name, addresses in psutil.net_if_addrs().items():
            if any(entry.address.split("%")[0] == address for entry in addresses):
                return str(name)
        return None
    names = {name for _, name in socket.if_nameindex()}
    if ipaddress.ip_address(address).is_loopback and "lo" in names:
        return "lo"  # Linux's loopback interface
    return None


def backend_for(device_type: str) -> str:
    """The process group backend of trainers whose dense model is on `device_type` ("cpu", "cuda")."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def _bind(local_address: str, variable: str) -> None:
    """Point gloo's (GLOO_SOCKET_IFNAME) or NCCL's (NCCL_SOCKET_IFNAME) sockets at the interface
    holding `local_address`."""
    if os.environ.get(variable):
        return  # the user's choice
    interface = interface_of(local_address)
    if interface is None:
        logger.warning(
            "no network interface holds %s: the process group listens on the address the host name "
            "resolves to (set %s to choose)",
            local_address,
            variable,
        )
        return
    os.environ[variable] = interface


def init_process_group(
    backend: str,
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    local_address: str,
    listen_fd: int | None = None,
    timeout: datetime.timedelta | None = None,
    join_timeout: datetime.timedelta | None = None,
) -> None:
    """Join the group whose store rank 0 serves on `master_address:master_port`.

    Rank 0 passes `listen_fd`, the descriptor of its `listen(master_address)` socket (the store takes
    it over); `local_address` is this rank's own address, where its gloo device listens. `timeout`
    bounds every collective and store operation; `join_timeout`, when given, the wait for the other
    ranks to join instead (a rank that dies before the group is formed then fails the others' wait
    that soon).
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if (rank == 0) != (listen_fd is not None):
        raise ValueError(f"rank {rank}: listen_fd is the store socket of rank 0, and only of rank 0")
    timeout = timeout or default_pg_timeout
    joining = join_timeout or timeout
    if "gloo" in backend:
        _bind(local_address, "GLOO_SOCKET_IFNAME")
    if "nccl" in backend:
        _bind(local_address, "NCCL_SOCKET_IFNAME")
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=joining,
        master_listen_fd=listen_fd,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=joining)
    if joining != timeout:
        store.set_timeout(timeout)
        _set_pg_timeout(timeout)
