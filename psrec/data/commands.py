"""`psrec data ...` subcommands (convert, synth). Filled in by the input pipeline."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    data = subparsers.add_parser("data", help="convert or synthesise datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    del data_sub  # subcommands are added by the input pipeline


def _unused(args: argparse.Namespace) -> int:  # pragma: no cover
    return 0
