"""Load on `psrec serve`: requests/s, scored rows/s and p50/p99 latency at 1, 8 and 64 clients.

Trains nothing itself: give it an export and rows to send (a libfm/Parquet/CSV file read with the
export's schema is the usual source), or let it train a short Frappe DeepFM first:

    python benchmarks/serve_load.py --frappe ../shared/data --rounds 3            # trains, exports, serves
    python benchmarks/serve_load.py --model models/frappe --rows rows.json        # an existing export

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

CLIENTS = (1, 8, 64)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_round(
    port: int, bodies: list[bytes], *, clients: int, requests: int, seconds: float
) -> dict[str, float]:
    """One bounded round: ``clients`` threads, each up to ``requests`` requests or ``seconds``."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine = []
        try:
            for count in range(requests):
                if time.monotonic() > deadline:
                    break
                body = bodies[(index + count) % len(bodies)]
                started = time.perf_counter()
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
    config = load_config(
        Path(__file__).parent.parent / "examples" / "frappe_deepfm.yaml", overrides=overrides
    )
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
    parser.add_argument("--save-rows", help="also write the request rows here (JSON, for --rows)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()

    import ray

    from psrec.serve.deployment import ServeOptions, start_serving, stop_serving
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
    port = free_port()
    if args.save_rows:
        Path(args.save_rows).write_text(json.dumps(rows))
    options = ServeOptions(port=port, replicas=args.replicas, batch_wait_seconds=args.batch_wait_ms / 1000)
    report["batch_wait_ms"] = args.batch_wait_ms
    start_serving(str(model_dir), options)
    try:
        run_round(port, bodies[:4], clients=1, requests=20, seconds=10)  # warm up
        results: dict[int, list[dict[str, float]]] = {clients: [] for clients in CLIENTS}
        started_cpu = time.process_time()
        for _ in range(args.rounds):  # client counts interleaved within every round
            for clients in CLIENTS:
                results[clients].append(
                    run_round(port, bodies, clients=clients, requests=args.requests, seconds=args.seconds)
                )
        report["client_process_cpu_seconds"] = time.process_time() - started_cpu
    finally:
        stop_serving()
        ray.shutdown()
    report["levels"] = {}
    for clients, rounds in results.items():
        level = {
            key: statistics.median(r[key] for r in rounds)
            for key in ("requests_per_second", "p50_ms", "p99_ms")
        }
        level["rows_per_second"] = level["requests_per_second"] * size
        level["errors"] = sum(r["errors"] for r in rounds)
        report["levels"][clients] = level
        print(
            f"{clients:>3} clients: {level['requests_per_second']:8.1f} req/s {level['rows_per_second']:9.0f} rows/s "
            f"p50 {level['p50_ms']:6.1f} ms  p99 {level['p99_ms']:6.1f} ms  errors {level['errors']}"
        )
    if "serving_table_bytes" in report:
        train_bytes = report["training_table_bytes"]
        for precision, nbytes in report["serving_table_bytes"].items():
            print(
                f"serving tables {precision}: {nbytes / 2**20:.2f} MiB = {nbytes / train_bytes:.3f} x training tables"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def load_frappe_rows(data_dir: str, count: int) -> list[dict[str, Any]]:
    """Frappe test rows as request rows (field -> pass-through id), read with the example's schema."""
    from psrec.config import load_config
    from psrec.data.reader import open_reader

    config = load_config(Path(__file__).parent.parent / "examples" / "frappe_deepfm.yaml")
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
