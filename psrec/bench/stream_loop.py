"""`psrec stream CONFIG`: the online loop on this machine, end to end, and how fresh it serves.

    psrec stream examples/stream_quickstart.yaml                       # 60 s at 2,000 events/s
    psrec stream examples/stream_quickstart.yaml --rate 4000 --seconds 120 --trainers 2 --json out.json
    psrec stream CONFIG --bootstrap-servers broker-1:9092 --topic clicks-test   # a real Kafka cluster

What runs, each in its own process, as a user runs them:

1. a Kafka-protocol broker on 127.0.0.1 (the Tansu broker of the `dev` extra,
   `psrec.testing.kafka_broker`), unless `--bootstrap-servers` names one;
2. a producer of the drifting CTR stream (`psrec.data.stream_synth`: ids born and retired as time
   goes, every message timestamped with its event time) at `--rate` events per second, keyed by
   user over the topic's partitions (one per trainer);
3. `psrec train CONFIG` in continuous mode (`training.mode: continuous`), publishing a checkpoint
   every `checkpoint.every_seconds`;
4. once the first checkpoint is written, `psrec export` and `psrec serve --follow RUN_DIR`, which
   applies each new checkpoint as it is committed.

Freshness is measured, not claimed: the harness asks the server which model version it serves
(`GET /version`) every `--probe-seconds`, reads which Kafka offsets that checkpoint had trained
(its `trainers.json`), and gives every event produced after the server came up the time from its
event timestamp to the first probe that saw a version holding it: the "event -> first served score
that reflects it" latency, with p50, p99 and max. Events no served version held by the end are
counted apart (`unserved`). Throughput: the rate is sustained when the lag (events behind the partitions' ends, from the
run's summary) stays bounded while measured; the report gives its largest value.

When the producer is done, the harness waits until the server holds every event (at most
`--drain-seconds`), then stops the server and the training run (SIGTERM: a last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

PROBE_SECONDS = 0.1
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "stream",
        help="run the online loop here (broker, stream, continuous training, serving) and measure freshness",
    )
    parser.add_argument(
        "config", help="a run config with data.train of format kafka (examples/stream_quickstart.yaml)"
    )
    parser.add_argument("--rate", type=float, default=2000.0, help="events per second produced (2000)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the stream runs (60)")
    parser.add_argument(
        "--trainers", type=int, help="ps.num_trainers (default: the config's); one partition each"
    )
    parser.add_argument("--bootstrap-servers", help="a Kafka cluster to use (default: start a local broker)")
    parser.add_argument("--topic", help="the topic (default: a new one per run)")
    parser.add_argument("--run-dir", help="the training run's directory (default: a temporary one)")
    parser.add_argument("--local", action="store_true", help="train in one process (no Ray)")
    parser.add_argument("--probe-seconds", type=float, default=PROBE_SECONDS, help="how often GET /version")
    parser.add_argument("--drain-seconds", type=float, default=120.0, help="longest wait for the last events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.set_defaults(func=run)


@dataclass
class Probe:
    """What the server served, as the harness saw it: (time, checkpoint name) at each change."""

    changes: list[tuple[float, str]] = field(default_factory=list)
    errors: int = 0

    def watch(self, url: str, every: float, stop: threading.Event) -> None:
        current = None
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url + "/version", timeout=5) as response:
                    name = json.loads(response.read())["checkpoint"]["checkpoint"]
                if name != current:
                    self.changes.append((time.time(), name))
                    current = name
            except (OSError, ValueError, KeyError):
                self.errors += 1
            stop.wait(every)


def run(args: argparse.Namespace) -> int:
    from psrec.config import ConfigError, load_config

    overrides: dict[str, Any] = {}
    if args.trainers is not None:
        overrides["ps.num_trainers"] = args.trainers
    if args.local:
        overrides["ps.runtime"] = "local"
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if (
        config.training.mode != "continuous"
        or config.data.train is None
        or config.data.train.format != "kafka"
    ):
        print(
            "error: psrec stream runs a config with training.mode continuous and data.train of format kafka",
            file=sys.stderr,
        )
        return 2
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="psrec-stream-")))
        servers = args.bootstrap_servers
        if servers is None:
            servers = _local_broker(stack, work)
        report = _loop(args, config, servers, work, stack)
    print(_format(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _local_broker(stack: ExitStack, work: Path) -> str:
    from psrec.testing.kafka_broker import KafkaBroker

    broker = KafkaBroker(work / "broker", in_memory=True)
    stack.callback(broker.close)
    try:
        broker.start()
    except (OSError, RuntimeError) as error:  # e.g. the dev extra (the broker binary) is missing
        raise SystemExit(
            f"psrec stream: no local broker ({error}); install psrec[dev] or give --bootstrap-servers"
        ) from None
    return broker.bootstrap_servers


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _psrec(*words: str) -> list[str]:
    return [sys.executable, "-m", "psrec.cli", *words]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _loop(
    args: argparse.Namespace, config: Any, servers: str, work: Path, stack: ExitStack
) -> dict[str, Any]:
    from psrec.data.stream_synth import DriftingCtrStream, ensure_topic, event_partitions, produce_stream

    trainers = config.ps.num_trainers
    topic = args.topic or f"psrec-stream-{uuid.uuid4().hex[:8]}"
    run_dir = Path(args.run_dir) if args.run_dir else work / "run"
    ensure_topic(servers, topic, trainers)
    data = config.model_dump(mode="json", by_alias=True)
    data["run_dir"] = str(run_dir)
    data["data"]["train"] |= {"bootstrap_servers": servers, "topics": [topic]}
    config_path = work / "stream.yaml"
    config_path.write_text(yaml.safe_dump(data))
    environment = dict(os.environ)
    logs = work / "logs"
    logs.mkdir()

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        out = (logs / f"{name}.log").open("wb")
        stack.callback(out.close)
        process = subprocess.Popen(command, env=environment, stdout=out, stderr=subprocess.STDOUT)
        stack.callback(_stop, process)
        return process

    # produced from the start (training needs events before its first checkpoint), measured for
    # --seconds once the server is up, then stopped
    most = int(args.rate * (args.seconds + 2 * START_TIMEOUT_S))
    stream = DriftingCtrStream(args.seed, events_per_second=max(1, int(args.rate)))
    stop_producing = threading.Event()
    trainer = start("train", _psrec("train", str(config_path), "--no-progress"))
    produced: dict[str, Any] = {}

    def produce() -> None:
        produced["summary"] = produce_stream(
            servers,
            topic,
            stream,
            events=most,
            rate_per_second=args.rate,
            partitions=trainers,
            stop=stop_producing,
        )

    producer = threading.Thread(target=produce, name="psrec-stream-producer", daemon=True)
    producer.start()
    first = _wait_for_checkpoint(run_dir, trainer, logs)
    model_dir = work / "model"
    subprocess.run(
        _psrec("export", str(run_dir), "--out", str(model_dir), "--checkpoint", first),
        env=environment,
        check=True,
        capture_output=True,
    )
    port = _free_port()
    server = start("serve", _psrec("serve", str(model_dir), "--port", str(port), "--follow", str(run_dir)))
    url = f"http://127.0.0.1:{port}"
    _wait_for_server(url, server, logs)
    serving_from = time.time()
    probe = Probe()
    stop_probing = threading.Event()
    prober = threading.Thread(target=probe.watch, args=(url, args.probe_seconds, stop_probing), daemon=True)
    prober.start()
    time.sleep(args.seconds)
    stop_producing.set()
    producer.join()
    summary = produced["summary"]
    events = summary.events
    partitions = event_partitions(stream.table(0, events), trainers, "user")
    offsets = _offsets_in_partitions(partitions, trainers)
    event_ms = summary.start_ms + np.arange(events, dtype=np.int64) * 1000 // stream.events_per_second
    deadline = time.monotonic() + args.drain_seconds
    while time.monotonic() < deadline and not _all_served(probe, run_dir, topic, summary.per_partition):
        time.sleep(0.5)
    stop_probing.set()
    prober.join()
    _stop(server)
    _stop(trainer)
    served = _served_at(probe, run_dir, topic, partitions, offsets, trainers)
    measured = event_ms >= serving_from * 1000  # events produced once the server was up
    latency = served[measured] - event_ms[measured] / 1000
    reflected = latency[np.isfinite(latency)]
    run_summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    points = run_summary.get("stream", {}).get("points", [])
    window = [p for p in points if serving_from <= p["time"] <= serving_from + args.seconds]
    return {
        "machine": _machine(),
        "trainers": trainers,
        "runtime": config.ps.runtime,
        "rate": args.rate,
        "events": events,
        "produced_seconds": summary.seconds,
        "measured_events": int(measured.sum()),
        "unserved": int(measured.sum() - reflected.size),
        "freshness_seconds": {
            "p50": float(np.percentile(reflected, 50)) if reflected.size else None,
            "p99": float(np.percentile(reflected, 99)) if reflected.size else None,
            "max": float(reflected.max()) if reflected.size else None,
        },
        "versions_served": len(probe.changes),
        "checkpoint_every_seconds": config.checkpoint.every_seconds,
        "trained_events_per_second": events / max(1e-9, summary.seconds),
        "rows_consumed": run_summary.get("rows_consumed"),
        "max_events_behind": max((p["events_behind"] for p in window), default=None),
        "max_seconds_behind": max((p["seconds_behind"] for p in window), default=None),
        "progressive_auc": run_summary.get("stream", {}).get("progressive_auc"),
        "progressive_logloss": run_summary.get("stream", {}).get("progressive_logloss"),
    }


def _wait_for_checkpoint(run_dir: Path, trainer: subprocess.Popen[bytes], logs: Path) -> str:
    from psrec.checkpoint import list_checkpoints

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise SystemExit(
                f"psrec stream: training ended early:\n{(logs / 'train.log').read_text()[-3000:]}"
            )
        refs = [ref for ref in list_checkpoints(run_dir) if ref.step > 0] if run_dir.is_dir() else []
        if refs:
            return str(refs[-1].name)
        time.sleep(0.2)
    raise SystemExit(f"psrec stream: no checkpoint in {START_TIMEOUT_S:.0f} s (see {logs / 'train.log'})")


def _wait_for_server(url: str, server: subprocess.Popen[bytes], logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"psrec stream: the server ended:\n{(logs / 'serve.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/version", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"psrec stream: the server did not answer in {START_TIMEOUT_S:.0f} s")


def _offsets_in_partitions(partitions: np.ndarray, count: int) -> np.ndarray:
    """Each event's offset in its partition (a new topic: the partition's events in order from 0)."""
    offsets = np.zeros(partitions.size, np.int64)
    for partition in range(count):
        mine = np.flatnonzero(partitions == partition)
        offsets[mine] = np.arange(mine.size)
    return offsets


def _trained_offsets(run_dir: Path, name: str, topic: str) -> dict[int, int]:
    """partition -> next offset, over every trainer, of checkpoint `name` of the run."""
    from psrec.data.kafka_source import merge_positions

    recorded = json.loads((run_dir / "checkpoints" / name / "trainers.json").read_text())
    positions = [t["position"] for t in recorded["trainers"] if t.get("position")]
    offsets = merge_positions(positions)["offsets"].get(topic, {}) if positions else {}
    return {int(partition): int(offset) for partition, offset in offsets.items()}


def _all_served(probe: Probe, run_dir: Path, topic: str, per_partition: tuple[int, ...]) -> bool:
    if not probe.changes:
        return False
    try:
        trained = _trained_offsets(run_dir, probe.changes[-1][1], topic)
    except OSError:  # retention removed it: a newer one is served soon
        return False
    return all(trained.get(p, 0) >= count for p, count in enumerate(per_partition))


def _served_at(
    probe: Probe, run_dir: Path, topic: str, partitions: np.ndarray, offsets: np.ndarray, count: int
) -> np.ndarray:
    """Per event, when the first served version holding it was seen (inf: never)."""
    served = np.full(partitions.size, np.inf)
    reached = dict.fromkeys(range(count), 0)
    for seen_at, name in probe.changes:
        try:
            trained = _trained_offsets(run_dir, name, topic)
        except OSError:
            continue
        for partition in range(count):
            now = trained.get(partition, 0)
            if now > reached[partition]:
                newly = (partitions == partition) & (offsets >= reached[partition]) & (offsets < now)
                served[newly] = np.minimum(served[newly], seen_at)
                reached[partition] = now
    return served


def _machine() -> dict[str, Any]:
    from psrec.machine import describe_machine

    machine = describe_machine()
    return {"cpu_model": machine.get("cpu_model"), "cores": os.cpu_count()}


def _format(report: dict[str, Any]) -> str:
    fresh = report["freshness_seconds"]

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    return "\n".join(
        [
            f"machine: {report['machine']['cpu_model']}, {report['machine']['cores']} cores",
            f"stream: {report['events']} events at {report['rate']:.0f}/s over {report['trainers']} "
            f"trainer(s) ({report['runtime']}), checkpoint every {report['checkpoint_every_seconds']} s",
            f"freshness (event -> first served version holding it), {report['measured_events']} events: "
            f"p50 {seconds(fresh['p50'])}, p99 {seconds(fresh['p99'])}, max {seconds(fresh['max'])}; "
            f"unserved {report['unserved']}",
            f"trained {report['rows_consumed']} events ({report['trained_events_per_second']:.0f}/s); lag "
            f"while measured: at most {report['max_events_behind']} events, {seconds(report['max_seconds_behind'])}; "
            f"progressive AUC {report['progressive_auc'] or float('nan'):.4f}; "
            f"{report['versions_served']} versions served",
        ]
    )
