"""`psrec scale RUN_DIR [--shards N] [--trainers N]`: change a running job's shard and / or trainer
count. The command writes a request into the run directory; the job's driver picks it up between
steps (`psrec.elastic.resharding.ScaleController`) and reports the result there.

    psrec scale runs/NAME --shards 4 --trainers 2 --wait 600
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from psrec.elastic.resharding import ScaleError, request_scale, wait_for


def register(subparsers: Any) -> None:
    """Add `psrec scale` to the CLI's subcommands."""
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
    scale.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`psrec scale RUN_DIR [--shards N] [--trainers N]`: write the request the driver picks up
    between steps."""
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
