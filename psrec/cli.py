"""The `psrec` command line: `psrec train|data|plan|scale|bench|export|serve|stream ...`.

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

from psrec.allocator import tune_malloc

# The module that registers each subcommand (its `register(subparsers)`), in `psrec --help` order.
# A command line names one, and only that module is imported: they import what their commands
# need at the top (psrec bench: torch), which the others should not pay for at start-up.
COMMAND_MODULES = {
    "train": "psrec.train.cli",
    "data": "psrec.data.cli",
    "plan": "psrec.parallel.cli",
    "scale": "psrec.elastic.cli",
    "bench": "psrec.bench.cli",
    "export": "psrec.serve.cli",
    "serve": "psrec.serve.cli",
    "stream": "psrec.bench.stream_loop",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with `command` (a subcommand's name) of that one only."""
    parser = argparse.ArgumentParser(prog="psrec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    known = command in COMMAND_MODULES
    for module in dict.fromkeys(COMMAND_MODULES.values()):
        if not known or module == COMMAND_MODULES.get(command or ""):
            import_module(module).register(subparsers)
    return parser


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
