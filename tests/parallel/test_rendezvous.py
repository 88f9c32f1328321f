"""The process group's store and gloo listen on the address they are given, never on all interfaces."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from psrec.parallel import rendezvous
from psrec.parallel.launch import run_local_group
from tests.conftest import is_loopback, listening_sockets


@pytest.fixture
def gloo_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLOO_SOCKET_IFNAME as the test found it, whatever the code under test sets."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")


def test_loopback_interface_is_found_with_and_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rendezvous.interface_of("127.0.0.1") == "lo"
    monkeypatch.setattr(rendezvous, "_psutil", lambda: None)
    assert rendezvous.interface_of("127.0.0.1") == "lo"
    assert rendezvous.interface_of("192.0.2.1") is None  # TEST-NET-1: on no interface


def test_store_serves_on_the_socket_rank_0_bound(gloo_interface: None) -> None:
    listener = rendezvous.listen("127.0.0.1")
    port = listener.getsockname()[1]
    rendezvous.init_process_group(
        "gloo",
        master_address="127.0.0.1",
        master_port=port,
        rank=0,
        world_size=1,
        local_address="127.0.0.1",
        listen_fd=listener.detach(),
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        sockets = listening_sockets([os.getpid()])
        assert (os.getpid(), "tcp", "127.0.0.1", port) in sockets
        assert not [s for s in sockets if s[3] == port and s[2] != "127.0.0.1"], sockets
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    finally:
        dist.destroy_process_group()


def test_only_rank_0_brings_the_store_socket() -> None:
    with pytest.raises(ValueError, match="rank 0"):
        rendezvous.init_process_group(
            "gloo", master_address="127.0.0.1", master_port=1, rank=0, world_size=2, local_address="127.0.0.1"
        )
    with socket.socket() as sock, pytest.raises(ValueError, match="rank 1"):
        rendezvous.init_process_group(
            "gloo",
            master_address="127.0.0.1",
            master_port=1,
            rank=1,
            world_size=2,
            local_address="127.0.0.1",
            listen_fd=sock.fileno(),
        )


def _own_listening_sockets(rank: int, world_size: int) -> list[tuple[int, str, str, int]]:
    dist.barrier()  # every rank's gloo pairs are connected
    return listening_sockets([os.getpid()])


def test_local_group_listens_on_loopback_only() -> None:
    import ray  # noqa: F401  - imported before the fork: the ranks find Ray's psutil

    per_rank = run_local_group(_own_listening_sockets, world_size=2, timeout=60.0)
    assert all(per_rank), per_rank  # rank 0 serves the store; every rank's gloo device listens
    outside = [s for sockets in per_rank for s in sockets if not is_loopback(s[2])]
    assert not outside, f"listening beyond loopback: {outside}"
