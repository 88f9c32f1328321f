"""Shared fixtures: one embedded Ray cluster per test module, only for tests that ask for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED_DATA = Path(
    os.environ.get("PSREC_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A fresh local Ray cluster on loopback (never a stray cluster on the host), torn down after the module."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The licensed datasets in ../shared/data; tests that need them skip cleanly when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set PSREC_SHARED_DATA)")
    return SHARED_DATA
