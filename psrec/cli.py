"""The `psrec` command line: `psrec train|data|plan|bench|export|serve ...`.

This is the only place that parses arguments, sets up logging and prints for the user; each
subcommand lives in the `cli` module of the package it drives and registers itself here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from importlib import import_module
from types import FrameType
from typing import Any

from psrec.allocator import tune_malloc

# The module that registers each subcommand (its `register(subparsers)`), in `psrec --help` order.
# A command line names one, and only that module is imported: they import what their commands
# need at the top (psrec bench: torch), which the others should not pay for at start-up.
COMMAND_MODULES = {
    "train": "psrec.train.cli",
    "data": "psrec.data.cli",
    "plan": "psrec.parallel.cli",
    "bench": "psrec.bench.cli",
    "export": "psrec.serve.cli",
    "serve": "psrec.serve.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `command` (a subcommand's name) of that one only."""
    parser = argparse.ArgumentParser(prog="psrec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    known = command in COMMAND_MODULES or command == "scale"
    for module in dict.fromkeys(COMMAND_MODULES.values()):
        if not known or module == COMMAND_MODULES.get(command or ""):
            import_module(module).register(subparsers)
    if not known or command == "scale":
        _register_scale(subparsers)
    return parser


def _register_scale(subparsers: Any) -> None:
    scale = subparsers.add_parser(
        "scale",
        help="change the shard and / or trainer count of a job while it trains",
        description="Change the PS shard count and / or the trainer count of a job while it trains "
        "(strategy ps; trainers on Ray only, without a pipeline, with fault_tolerance.shard_failover "
        "off). Trainers change at a step boundary: the rows not yet trained on in the epoch are dealt "
        "to the new trainers, each row once; a step is then N trainers' batches (global batch = "
        "training.batch_size x N). See docs/fault_tolerance.md.",
    )
    scale.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the training job")
    scale.add_argument("--shards", type=int, default=None, help="the new number of PS shards")
    scale.add_argument("--trainers", type=int, default=None, help="the new number of trainers")
    scale.add_argument(
        "--buckets-per-round", type=int, default=64, help="virtual buckets moved per step boundary"
    )
    scale.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="wait for the result")
    scale.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    """`psrec scale RUN_DIR [--shards N] [--trainers N]`: write the request the driver picks up
    between steps."""
    import json

    from psrec.train.scaling import ScaleError, request_scale, wait_for

    try:
        request = request_scale(
            args.run_dir, args.shards, trainers=args.trainers, buckets_per_round=args.buckets_per_round
        )
        asked = ", ".join(f"{request[key]} {key}" for key in ("shards", "trainers") if key in request)
        print(f"request {request['id']}: {asked}, written to {args.run_dir}/scale-request.json")
        if args.wait <= 0:
            return 0
        entry = wait_for(args.run_dir, request["id"], timeout=args.wait)
    except ScaleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(entry, indent=2, default=float))
    return 0 if entry["state"] == "done" else 1


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()  # the command's start: `psrec train` reports its time to the first step
    # Before torch loads: OpenMP threads that spin-wait for work steal the cores that the other
    # processes of a run (shards, trainers, the data reader) need; sleeping waiters measured 3-7x
    # faster on shared cores (docs/benchmarks.md). An explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tune_malloc()  # freed buffers stay mapped for the next step (psrec.allocator)
    signal.signal(signal.SIGTERM, _terminate)  # shut the workers down as Ctrl-C does
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    args.started_at = started_at
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


def _command(argv: list[str]) -> str | None:
    """The subcommand a command line names (its first word that is no option), None when the
    top-level help is asked for first."""
    for word in argv:
        if word in ("-h", "--help"):
            return None
        if not word.startswith("-"):
            return word
    return None


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
