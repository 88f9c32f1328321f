"""`psrec data synth`, `convert`, `interactions-ctr` and `produce`: make datasets and streams from the
command line.

    psrec data synth data/synth --rows 1000000 --files 4 --format parquet
    psrec data convert day_0.tsv.gz --format criteo_tsv --out data/criteo
    psrec data convert frappe.train.libfm --format libfm --config frappe.yaml --out data/frappe
    psrec data interactions-ctr ../shared/data/ml-1m/ml-1m.txt data/ml1m_ctr --max-length 50
    psrec data produce --bootstrap-servers 127.0.0.1:9092 --topic clicks --rate 2000 --seconds 60

`--config` is a YAML file with `schema:` (a `Schema`) and optionally `source:` (`DataSource` options
such as `delimiter`, `header`, `columns`, `field_ranges`, `on_error`; `format` and `paths` come from
the command line). Without it, criteo_tsv uses `criteo_schema()`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def register(subparsers: Any) -> None:
    data = subparsers.add_parser("data", help="convert or synthesise datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True)

    synth = data_sub.add_parser("synth", help="write a synthetic Criteo-shaped dataset")
    synth.add_argument("output", type=Path, help="output directory")
    synth.add_argument("--rows", type=int, required=True)
    synth.add_argument("--files", type=int, default=1)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--format", choices=["parquet", "tsv", "tsv.gz"], default="parquet")
    synth.add_argument("--cardinality-scale", type=float, default=1.0, help="shrink Criteo's cardinalities")
    synth.add_argument("--row-group-rows", type=int, default=65536)
    synth.set_defaults(func=run_synth)

    convert = data_sub.add_parser("convert", help="convert raw TSV/CSV/libfm files to Parquet")
    convert.add_argument("inputs", nargs="+", help="input files or globs")
    convert.add_argument(
        "--format",
        choices=["criteo_tsv", "csv", "libfm", "parquet"],
        required=True,
        help="parquet: with --prepared",
    )
    convert.add_argument("--out", type=Path, required=True, help="output directory")
    convert.add_argument("--config", type=Path, help="YAML with `schema:` and optional `source:` options")
    convert.add_argument("--on-error", choices=["raise", "skip"], default=None)
    convert.add_argument("--row-group-rows", type=int, default=65536)
    convert.add_argument(
        "--prepared",
        action="store_true",
        help="write the rows as training prepares them (hashed int64 ids, transformed dense values): "
        "reading skips decoding text and hashing; the files only serve this schema",
    )
    convert.set_defaults(func=run_convert)

    ctr = data_sub.add_parser(
        "interactions-ctr",
        help="frame a 'user item' interaction file as CTR (history, next item vs a sampled negative)",
    )
    ctr.add_argument("input", type=Path, help="interaction file: 'user item' lines in time order")
    ctr.add_argument("output", type=Path, help="output directory (train/, validation/, test/)")
    ctr.add_argument("--max-length", type=int, default=50, help="history length kept (last items)")
    ctr.add_argument("--positions-per-user", type=int, default=50, help="training targets per user (last)")
    ctr.add_argument("--seed", type=int, default=0)
    ctr.add_argument("--row-group-rows", type=int, default=65536)
    ctr.set_defaults(func=run_interactions_ctr)

    produce = data_sub.add_parser(
        "produce",
        help="produce a synthetic click stream with drifting ids into a Kafka topic at a steady rate",
        description="Events of psrec.data.stream_synth.DriftingCtrStream, timestamped with their event "
        "time (event i: now + i / events-per-second), keyed by --key; the topic is created if missing.",
    )
    produce.add_argument("--bootstrap-servers", required=True, help="HOST:PORT[,HOST:PORT...]")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--rate", type=float, required=True, help="messages per second (wall time)")
    length = produce.add_mutually_exclusive_group(required=True)
    length.add_argument("--seconds", type=float, help="produce rate * seconds events")
    length.add_argument("--events", type=int, help="how many events to produce")
    produce.add_argument("--partitions", type=int, default=None, help="of a topic created (default 1)")
    produce.add_argument("--key", choices=["user", "item", "none"], default="user", help="partition key")
    produce.add_argument("--format", choices=["json", "tsv", "csv"], default="json", help="message format")
    produce.add_argument("--seed", type=int, default=0)
    produce.add_argument(
        "--events-per-second", type=int, default=None, help="event-time density (default: --rate)"
    )
    produce.add_argument("--items-per-second", type=float, default=2.0, help="new item ids per second")
    produce.add_argument("--item-lifetime", type=float, default=300.0, help="seconds an item id is alive")
    produce.add_argument("--users-per-second", type=float, default=5.0, help="new user ids per second")
    produce.add_argument("--user-lifetime", type=float, default=600.0, help="seconds a user id is alive")
    produce.set_defaults(func=run_produce)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def run_synth(args: argparse.Namespace) -> int:
    from psrec.data.synth import write_synthetic_criteo

    console = Console(stderr=True)
    with _progress(console) as progress:
        task = progress.add_task("rows", total=args.rows)
        paths = write_synthetic_criteo(
            args.output,
            rows=args.rows,
            files=args.files,
            seed=args.seed,
            format=args.format,
            cardinality_scale=args.cardinality_scale,
            row_group_rows=args.row_group_rows,
            progress=lambda done: progress.update(task, completed=done),
        )
    console.print(f"wrote {args.rows} rows to {len(paths)} file(s) in {args.output}")
    return 0


def _load_config(args: argparse.Namespace) -> tuple[Any, Any]:
    from psrec.data.schema import DataSource, Schema
    from psrec.data.synth import criteo_schema

    config: dict[str, Any] = {}
    if args.config is not None:
        config = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{args.config}: expected a mapping with `schema:` and `source:`")
        unknown = set(config) - {"schema", "source"}
        if unknown:
            raise ValueError(f"{args.config}: unknown keys {sorted(unknown)} (expected schema, source)")
    options = dict(config.get("source") or {})
    options.update(format=args.format, paths=args.inputs)
    if args.on_error is not None:
        options["on_error"] = args.on_error
    source = DataSource.model_validate(options)
    if "schema" in config:
        schema = Schema.model_validate(config["schema"])
    elif args.format == "criteo_tsv":
        schema = criteo_schema()
    else:
        raise ValueError(f"format {args.format!r} needs --config with a `schema:`")
    return source, schema


def run_convert(args: argparse.Namespace) -> int:
    from psrec.data.convert import convert_to_parquet
    from psrec.data.errors import BadRowError

    console = Console(stderr=True)
    if args.format == "parquet" and not args.prepared:
        console.print(
            "[red]error:[/red] --format parquet converts only with --prepared (Parquet is read as it is)"
        )
        return 2
    try:
        source, schema = _load_config(args)
    except (ValidationError, ValueError, OSError) as error:
        console.print(f"[red]invalid configuration:[/red] {escape(str(error))}")
        return 2
    try:
        with _progress(console) as progress:
            task = progress.add_task("bytes", total=None)
            paths, summary = convert_to_parquet(
                source,
                schema,
                args.out,
                row_group_rows=args.row_group_rows,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
                prepared=args.prepared,
            )
    except (BadRowError, FileNotFoundError, ValueError) as error:
        console.print(f"[red]error:[/red] {escape(str(error))}")
        return 1
    console.print(f"wrote {summary['rows']} rows to {len(paths)} Parquet file(s) in {args.out}")
    if summary["rows_skipped"]:
        console.print(f"skipped {summary['rows_skipped']} bad rows, e.g.:")
        console.print(json.dumps(summary["skipped_samples"][:5], indent=2), markup=False)
    if summary["units_failed"]:
        console.print(
            f"[red]{summary['units_failed']} file part(s) could not be read to their end[/red] "
            f"({summary['bytes_lost']} bytes lost; the rows before the damage were converted):"
        )
        console.print(json.dumps(summary["failed_units"][:5], indent=2), markup=False)
    return 0


def run_interactions_ctr(args: argparse.Namespace) -> int:
    from psrec.data.errors import BadRowError
    from psrec.data.interactions_ctr import write_interactions_ctr

    console = Console(stderr=True)
    if args.max_length < 1 or args.positions_per_user < 1 or args.row_group_rows < 1:
        console.print(
            "[red]error:[/red] --max-length, --positions-per-user and --row-group-rows must be >= 1"
        )
        return 2
    try:
        counts = write_interactions_ctr(
            [args.input],
            args.output,
            max_length=args.max_length,
            positions_per_user=args.positions_per_user,
            seed=args.seed,
            row_group_rows=args.row_group_rows,
        )
    except (BadRowError, OSError, ValueError) as error:
        console.print(f"[red]error:[/red] {escape(str(error))}")
        return 1
    shown = ", ".join(f"{split} {rows}" for split, rows in counts.items())
    console.print(f"wrote CTR rows to {args.output}: {shown}")
    return 0


def run_produce(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from psrec.data.stream_synth import DriftingCtrStream, produce_stream

    console = Console(stderr=True)
    events = args.events if args.events is not None else round(args.rate * args.seconds)
    try:
        stream = DriftingCtrStream(
            args.seed,
            events_per_second=args.events_per_second or max(1, round(args.rate)),
            items_per_second=args.items_per_second,
            item_lifetime_s=args.item_lifetime,
            users_per_second=args.users_per_second,
            user_lifetime_s=args.user_lifetime,
        )
        with _progress(console) as progress:
            task = progress.add_task("events", total=events)
            summary = produce_stream(
                args.bootstrap_servers,
                args.topic,
                stream,
                events=events,
                rate_per_second=args.rate,
                partitions=args.partitions,
                key=args.key,
                message_format=args.format,
                progress=lambda done: progress.update(task, completed=done),
            )
    except (KafkaException, RuntimeError, TimeoutError, ValueError) as error:
        console.print(f"[red]error:[/red] {escape(str(error))}")
        return 1
    shares = " / ".join(str(count) for count in summary.per_partition)
    console.print(
        f"produced {summary.events} events ({summary.message_bytes / 1e6:.1f} MB, {args.format}) to "
        f"{summary.topic} [{len(summary.per_partition)} partition(s): {shares}] in {summary.seconds:.2f} s "
        f"({summary.events_per_second:.0f}/s); event time {summary.start_ms}..{summary.end_ms} ms, "
        f"seed {args.seed}",
        highlight=False,
        soft_wrap=True,
    )
    return 0
