"""`psrec export` and `psrec serve`: register the two subcommands (parsed in `psrec.cli`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from psrec.serve.tables import PRECISIONS


def register(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export",
        help="a run's checkpoint as a serving export (dense program + tables, no optimizer state)",
        description="Export RUN_DIR's newest valid checkpoint (or --checkpoint NAME) to MODEL_DIR.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a psrec run directory (path or store URI)")
    export.add_argument("--out", required=True, metavar="MODEL_DIR", help="where to write the export")
    export.add_argument(
        "--precision", choices=PRECISIONS, default="fp32", help="row precision (default fp32)"
    )
    export.add_argument("--checkpoint", metavar="NAME", help="e.g. ckpt-000001200-delta (default: newest)")
    export.set_defaults(func=run_export)

    serve = subparsers.add_parser(
        "serve",
        help="serve an export over HTTP on Ray Serve (JSON rows in, scores or top-k items out)",
        description='Serve MODEL_DIR on Ray Serve: POST / with {"rows": [...]}; GET /version.',
    )
    serve.add_argument("model_dir", metavar="MODEL_DIR", help="an export written by `psrec export`")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--replicas", type=int, default=1, help="model replicas (default 1)")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    serve.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    serve.add_argument("--address", metavar="HOST:PORT", help="join this Ray cluster (default: embedded)")
    serve.add_argument("--follow", metavar="RUN_DIR", help="apply each new checkpoint of this run")
    serve.add_argument("--poll-seconds", type=float, default=0.5, help="how often --follow looks (0.5)")
    serve.add_argument("--max-batch-rows", type=int, default=4096, help="rows batched into one forward")
    serve.add_argument("--batch-wait-ms", type=float, default=1.0, help="longest wait to fill a batch (1)")
    serve.add_argument(
        "--direct-ingress",
        action="store_true",
        help="every replica also answers HTTP itself (no proxy hop; its URLs are logged at start)",
    )
    serve.add_argument(
        "--direct-port", type=int, default=30000, help="the first replica's own port (--direct-ingress)"
    )
    serve.add_argument("--shard-rows", type=int, metavar="N", help="tables above N rows go to lookup shards")
    serve.add_argument("--lookup-shards", type=int, default=2, help="lookup shard actors (with --shard-rows)")
    serve.set_defaults(func=run_serve)


def run_export(args: argparse.Namespace) -> int:
    from psrec.serve.export import export_run
    from psrec.serve.model_dir import ExportError

    try:
        info = export_run(args.run_dir, args.out, precision=args.precision, checkpoint=args.checkpoint)
    except ExportError as error:
        raise SystemExit(f"psrec export: {error}") from None
    tables = {name: {"rows": t["rows"], "bytes": t["bytes"]} for name, t in info["tables"].items()}
    print(
        json.dumps(
            {"out": args.out, "version": info["version"], "precision": info["precision"], "tables": tables},
            indent=1,
        )
    )
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from psrec.serve.deployment import ServeOptions, serve_forever
    from psrec.serve.model_dir import ExportError

    for name in ("port", "replicas", "threads", "max_batch_rows", "lookup_shards", "direct_port"):
        if getattr(args, name) < 1:
            raise SystemExit(
                f"psrec serve: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
            )
    options = ServeOptions(
        port=args.port,
        host=args.host,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        threads=args.threads,
        max_batch_rows=args.max_batch_rows,
        batch_wait_seconds=args.batch_wait_ms / 1000,
        follow=args.follow,
        poll_seconds=args.poll_seconds,
        shard_rows=args.shard_rows,
        lookup_shards=args.lookup_shards,
        direct_ingress=args.direct_ingress,
        direct_port=args.direct_port,
    )
    try:
        serve_forever(args.model_dir, options, address=args.address)
    except ExportError as error:
        raise SystemExit(f"psrec serve: {error}") from None
    return 0
