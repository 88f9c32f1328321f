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
from types import FrameType

from psrec.allocator import tune_malloc


def build_parser() -> argparse.ArgumentParser:
    from psrec.bench import cli as bench_commands
    from psrec.data import cli as data_commands
    from psrec.parallel import cli as parallel_commands
    from psrec.serve import cli as serve_commands
    from psrec.train import cli as train_commands

    parser = argparse.ArgumentParser(prog="psrec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_commands.register(subparsers)
    data_commands.register(subparsers)
    parallel_commands.register(subparsers)
    bench_commands.register(subparsers)
    serve_commands.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads: OpenMP threads that spin-wait for work steal the cores that the other
    # processes of a run (shards, trainers, the data reader) need; sleeping waiters measured 3-7x
    # faster on shared cores (docs/benchmarks.md). An explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tune_malloc()  # freed buffers stay mapped for the next step (psrec.allocator)
    signal.signal(signal.SIGTERM, _terminate)  # shut the workers down as Ctrl-C does
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
