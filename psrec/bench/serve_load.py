"""Load on `psrec serve`: requests/s, scored rows/s and p50/p99 latency at 1, 8 and 64 clients.

Trains nothing itself: give it an export and rows to send (a libfm/Parquet/CSV file read with the
export's schema is the usual source), or let it train a short Frappe DeepFM first:

    python -m psrec.bench.serve_load --frappe ../shared/data --rounds 3            # trains, exports, serves
    python -m psrec.bench.serve_load --model models/frappe --rows rows.json        # an existing export

It starts the app on an embedded loopback Ray cluster (HTTP on 127.0.0.1, a free port), then for
each client count runs ``--rounds`` rounds, each bounded by ``--requests`` requests per client and
``--seconds`` of wall time, clients on persistent HTTP connections, each request carrying
``--rows-per-request`` rows. Reported: the median over rounds of requests/s, rows/s and each
round's p50/p99 latency, plus the serving tables' bytes against the training tables' (from the
run's summary.json). The clients run on the same machine as the server and take CPU from it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from psrec.bench import EXAMPLES

CLIENTS = (1, 8, 64)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_round(
    port: int | list[int],
    bodies: list[bytes],
    *,
    clients: int,
    requests: int,
    seconds: float,
    rate: float | None = None,
) -> dict[str, float]:
    """One bounded round: ``clients`` threads, each up to ``requests`` requests or ``seconds``;
    client i talks to ``port[i % len(port)]`` when given several (the replicas' own ports).

    Closed loop (``rate`` None): each client sends its next request as soon as the last one is
    answered, so the figures are those of a saturated server. Open loop (``rate`` requests/s over
    all clients): request k of the round is due at ``k / rate`` s, dealt to the clients in turn; a
    client that is still waiting sends it late, and its latency counts from when it was due (the
    queueing a late sender hides is counted, as wrk2 does)."""
    ports = [port] if isinstance(port, int) else port
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    begin = time.perf_counter() + 0.05  # every client's schedule starts at one instant

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=30)
        mine = []
        try:
            for count in range(requests):
                if time.monotonic() > deadline:
                    break
                body = bodies[(index + count) % len(bodies)]
                started = time.perf_counter()
                if rate is not None:
                    due = begin + (count * clients + index) / rate
                    if due > started:
                        time.sleep(due - started)
                    started = due
                connection.request("POST", "/", body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                mine.append(time.perf_counter() - started)
                if response.status != 200:
                    with lock:
                        errors[0] += 1
        finally:
            connection.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 60)
    wall = time.perf_counter() - started
    latencies.sort()
    count = len(latencies)
    return {
        "requests": count,
        "errors": errors[0],
        "requests_per_second": count / wall,
        "p50_ms": 1000 * latencies[count // 2] if count else float("nan"),
        "p99_ms": 1000 * latencies[min(count - 1, int(count * 0.99))] if count else float("nan"),
    }


def train_frappe(data_dir: str, root: Path, epochs: int) -> Path:
    """A short run of examples/frappe_deepfm.yaml (checkpoints in ``root/run``)."""
    from psrec.config import load_config
    from psrec.train.loop import train

    overrides = {"run_dir": str(root / "run"), "training.epochs": epochs, "training.early_stopping": None}
    config = load_config(EXAMPLES / "frappe_deepfm.yaml", overrides=overrides)
    train(config, base_dir=data_dir)
    return root / "run"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--frappe", metavar="DATA_DIR", help="train a short Frappe DeepFM from DATA_DIR first"
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--model", help="an existing export (with --rows)")
    parser.add_argument("--rows", help="a JSON list of request rows (with --model)")
    parser.add_argument("--rows-per-request", type=int, default=32)
    parser.add_argument("--requests", type=int, default=300, help="per client and round, at most")
    parser.add_argument("--seconds", type=float, default=10.0, help="per round, at most")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-wait-ms", type=float, default=1.0, help="the server's --batch-wait-ms")
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="replicas also answer HTTP themselves; both paths measured, interleaved",
    )
    parser.add_argument(
        "--clients",
        type=lambda text: tuple(int(c) for c in text.split(",")),
        default=CLIENTS,
        help="client counts, comma-separated (default 1,8,64)",
    )
    parser.add_argument(
        "--rate-rows",
        type=float,
        action="append",
        default=None,
        help="also run open loop at this many offered rows/s over all clients (repeatable)",
    )
    parser.add_argument("--profile", action="store_true", help="also time each serving step in process")
    parser.add_argument("--save-rows", help="also write the request rows here (JSON, for --rows)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()

    import ray

    from psrec.serve.deployment import ServeOptions, replica_urls, start_serving, stop_serving
    from psrec.serve.export import export_run

    root = Path(tempfile.mkdtemp(prefix="psrec-serve-load-"))
    report: dict[str, Any] = {"cpus": os.cpu_count(), "rows_per_request": args.rows_per_request}
    if args.frappe:
        run_dir = train_frappe(args.frappe, root, args.epochs)
        summary = json.loads((run_dir / "summary.json").read_text())
        report["training_table_bytes"] = sum(int(t.get("total", 0)) for t in summary["tables"].values())
        exports = {}
        for precision in sorted({args.precision, "int8"}):
            info = export_run(run_dir, root / f"model-{precision}", precision=precision)
            exports[precision] = sum(t["bytes"] for t in info["tables"].values())
        report["serving_table_bytes"] = exports
        model_dir = root / f"model-{args.precision}"
        rows = load_frappe_rows(args.frappe, 20_000)
    else:
        if not (args.model and args.rows):
            parser.error("give --frappe DATA_DIR, or --model MODEL_DIR with --rows ROWS.json")
        model_dir = Path(args.model)
        rows = json.loads(Path(args.rows).read_text())
    size = args.rows_per_request
    bodies = [json.dumps({"rows": rows[i : i + size]}).encode() for i in range(0, len(rows) - size + 1, size)]
    if args.save_rows:
        Path(args.save_rows).write_text(json.dumps(rows))
    if args.profile:
        report["in_process_ms"] = in_process_breakdown(str(model_dir), bodies)
    port = free_port()
    options = ServeOptions(
        port=port,
        replicas=args.replicas,
        batch_wait_seconds=args.batch_wait_ms / 1000,
        direct_ingress=args.direct_ingress,
        direct_port=free_port_range(),
    )
    report["batch_wait_ms"] = args.batch_wait_ms
    report["load_average_before"] = os.getloadavg()
    start_serving(str(model_dir), options)
    paths: dict[str, int | list[int]] = {"proxy": port}
    if args.direct_ingress:  # the same app answers on both paths: measured interleaved
        paths["direct"] = [int(url.rstrip("/").rsplit(":", 1)[1]) for url in replica_urls()]
    try:
        for target in paths.values():
            run_round(target, bodies[:4], clients=1, requests=20, seconds=10)  # warm up
        rates: list[float | None] = [None, *(args.rate_rows or [])]
        levels = [(path, clients, rate) for rate in rates for clients in args.clients for path in paths]
        results: dict[tuple[str, int, float | None], list[dict[str, Any]]] = {level: [] for level in levels}
        for _ in range(args.rounds):  # paths, client counts and rates interleaved within every round
            for path, clients, rate in levels:
                target = paths[path]
                before, client_before = process_cpu_seconds(), time.process_time()
                result: dict[str, Any] = run_round(
                    target,
                    bodies,
                    clients=clients,
                    requests=args.requests,
                    seconds=args.seconds,
                    rate=None if rate is None else rate / size,
                )
                after = process_cpu_seconds()
                count = max(1, int(result["requests"]))
                result["cpu_ms_per_request"] = {
                    name: 1000 * (after.get(name, 0.0) - before.get(name, 0.0)) / count
                    for name in after
                    if after.get(name, 0.0) - before.get(name, 0.0) > 0
                }
                result["cpu_ms_per_request"]["load generator"] = (
                    1000 * (time.process_time() - client_before) / count
                )
                result["load_average"] = os.getloadavg()[0]
                results[(path, clients, rate)].append(result)
    finally:
        stop_serving()
        ray.shutdown()
    report["levels"] = {}
    for (path, clients, rate), rounds in results.items():
        level: dict[str, Any] = {
            key: statistics.median(r[key] for r in rounds)
            for key in ("requests_per_second", "p50_ms", "p99_ms", "load_average")
        }
        level["rows_per_second"] = level["requests_per_second"] * size
        level["errors"] = sum(r["errors"] for r in rounds)
        names = sorted({name for r in rounds for name in r["cpu_ms_per_request"]})
        level["cpu_ms_per_request"] = {
            name: statistics.median(r["cpu_ms_per_request"].get(name, 0.0) for r in rounds) for name in names
        }
        offered = "closed loop" if rate is None else f"offered {rate:.0f} rows/s"
        level["offered_rows_per_second"] = rate
        report["levels"][f"{path} {clients} {offered}"] = level
        cpu = ", ".join(f"{name} {ms:.1f}" for name, ms in level["cpu_ms_per_request"].items() if ms >= 0.1)
        print(
            f"{path:>6} {clients:>3} clients, {offered}: {level['requests_per_second']:7.1f} req/s "
            f"{level['rows_per_second']:7.0f} rows/s p50 {level['p50_ms']:6.1f} ms p99 {level['p99_ms']:6.1f} ms "
            f"errors {level['errors']} load {level['load_average']:.1f} | CPU ms/request: {cpu}"
        )
    if "in_process_ms" in report:
        print("in process (ms, median):", json.dumps(report["in_process_ms"]))
    if "serving_table_bytes" in report:
        train_bytes = report["training_table_bytes"]
        for precision, nbytes in report["serving_table_bytes"].items():
            print(
                f"serving tables {precision}: {nbytes / 2**20:.2f} MiB = {nbytes / train_bytes:.3f} x training tables"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def free_port_range(width: int = 16) -> int:
    """The first of ``width`` consecutive free loopback ports (the replicas' own, with direct ingress)."""
    for first in range(31000, 60000, width):
        try:
            probes = []
            for offset in range(width):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no range of free ports on 127.0.0.1")


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's descendants (the embedded Ray cluster), by name:
    Serve's proxy, the replicas, the controller, Ray's own processes (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    mine, grown = {os.getpid()}, True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                grown = True
    totals: dict[str, float] = {}
    for pid in mine - {os.getpid()}:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        name = command.removeprefix("ray::").split(":")[0] if command.startswith("ray::") else "ray (other)"
        totals[name] = totals.get(name, 0.0) + cpu.get(pid, 0.0)
    return totals


def in_process_breakdown(model_dir: str, bodies: list[bytes], repeats: int = 50) -> dict[str, float]:
    """Median milliseconds of each serving step without HTTP or Ray: decode, validate + featurize,
    score one request, score 8 requests batched, and the forward pass alone of those 8."""
    import torch

    from psrec.data.batch import concat_batches
    from psrec.serve.model_dir import MODEL_FILE
    from psrec.serve.requests import decode_body, parse_request
    from psrec.serve.scoring import ServingModel

    torch.set_num_threads(1)
    model = ServingModel.load(model_dir)
    parsed = [parse_request(decode_body(body), model.request_spec) for body in bodies[: repeats + 8]]
    version = model.version

    def timed(step: Any) -> float:
        times = []
        for index in range(repeats):
            started = time.perf_counter()
            step(index)
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)

    inputs = [
        model.model_input(version, concat_batches([p.batch for p in parsed[i : i + 8]]))
        for i in range(repeats)
    ]
    answers = [model.score_requests([p])[0] for p in parsed[:repeats]]
    with torch.no_grad():
        forward = timed(lambda i: version.programs[MODEL_FILE](*inputs[i]))
    return {
        "decode_json": timed(lambda i: decode_body(bodies[i])),
        "validate_and_featurize": timed(lambda i: parse_request(decode_body(bodies[i]), model.request_spec)),
        "score_1_request": timed(lambda i: model.score_requests([parsed[i]])),
        "score_8_requests_batched": timed(lambda i: model.score_requests(parsed[i : i + 8])),
        "forward_8_requests": forward,
        "encode_json_1_response": timed(lambda i: json.dumps(answers[i])),
    }


def load_frappe_rows(data_dir: str, count: int) -> list[dict[str, Any]]:
    """Frappe test rows as request rows (field -> pass-through id), read with the example's schema."""
    from psrec.config import load_config
    from psrec.data.reader import open_reader

    config = load_config(EXAMPLES / "frappe_deepfm.yaml")
    assert config.data.test is not None
    reader = open_reader(config.data.test, config.feature_schema(), batch_size=4096, base_dir=Path(data_dir))
    rows: list[dict[str, Any]] = []
    try:
        for batch in reader:
            for k, key in enumerate(batch.sparse.keys):
                ids = batch.sparse.ids[batch.sparse.key_starts[k] : batch.sparse.key_starts[k + 1]]
                if k == 0:
                    base = len(rows)
                    rows.extend({} for _ in range(ids.size))
                for i, value in enumerate(ids.tolist()):
                    rows[base + i][key] = value
            if len(rows) >= count:
                break
    finally:
        reader.close()
    return rows[:count]


if __name__ == "__main__":
    main()
