"""An S3-compatible server for the storage tests: moto's server mode on 127.0.0.1, started and
stopped with bounded waits, and the environment that points psrec's S3 file system at it.

Used through the fixtures `s3_server` (one per session) and `s3_bucket` (a fresh bucket and the
environment, per test) in ``tests/conftest.py``; tests without moto installed skip.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret"}


def _bounded(action: Callable[[], Any], timeout: float, what: str) -> None:
    """Run `action` in a thread and wait at most `timeout` seconds for it."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as error:  # reported in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True, name=f"moto-{what}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the moto server did not {what} within {timeout} s")
    if failure:
        raise failure[0]


class S3Server:
    """moto's threaded server on 127.0.0.1 and a free port."""

    def __init__(self) -> None:
        server_module = pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
        self._server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        _bounded(self._server.start, START_TIMEOUT_S, "start")
        self.host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "PSREC_STORAGE_CONNECT_TIMEOUT_S": "2",
            "PSREC_STORAGE_REQUEST_TIMEOUT_S": "10",
            "PSREC_STORAGE_ATTEMPTS": "2",
        }

    def create_bucket(self) -> str:
        import boto3

        name = f"psrec-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        _bounded(self._server.stop, STOP_TIMEOUT_S, "stop")
