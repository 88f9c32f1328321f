"""`psrec plan SPEC`: print where every embedding table goes, the memory per device and the traffic.

    psrec plan examples/plan_criteo_terabyte.yaml                       # 8 x 80 GB: a placement
    psrec plan examples/plan_criteo_terabyte.yaml --devices 2 --memory-gb 16   # refused, with why
    psrec plan SPEC --strategy ps --json
    psrec plan examples/plan_criteo_terabyte.yaml --devices 2 --memory-gb 16 --disk-tier  # rows on disk
    psrec plan examples/ml1m_hstu_large.yaml --memory-gb 0.25   # pipeline stages of a run's HSTU

Given a run config of an HSTU (a YAML with `model:`), it prints the fewest pipeline stages whose
every stage fits `--memory-gb` per device (`psrec.parallel.stage_planner`).

Exit status 0 with a plan, 2 when the plan file is invalid or the tables (or stages) do not fit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psrec.parallel.planner import ShardingPlan, TableSize
    from psrec.parallel.stage_planner import HSTUSize, StagePlan

GB = 10**9


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="place embedding tables on devices (sharding planner)")
    parser.add_argument(
        "spec",
        help="plan file: tables with rows, devices, strategy (see examples/plan_*.yaml); or a run "
        "config of an HSTU: the pipeline stages it needs for --memory-gb per device",
    )
    parser.add_argument("--devices", type=int, help="override devices.count")
    parser.add_argument("--memory-gb", type=float, help="override devices.memory_gb")
    parser.add_argument("--strategy", choices=["ps", "collective"], help="override strategy")
    parser.add_argument("--sharding", choices=["table_wise", "row_wise", "auto"], help="override sharding")
    parser.add_argument(
        "--disk-tier",
        action="store_true",
        help="keep in memory what fits, the rest on disk (disk_tier: true)",
    )
    parser.add_argument(
        "--microbatches", type=int, help="HSTU stages: micro-batches per batch (default: the run's, or 4)"
    )
    parser.add_argument(
        "--schedule", choices=["gpipe", "1f1b"], help="HSTU stages: pipeline schedule (default: the run's)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if is_run_config(args.spec):
        return run_stage_plan(args)
    from psrec.parallel.plan_spec import PlanSpecError, load_plan_spec
    from psrec.parallel.planner import PlanDoesNotFit, plan_disk_tier, plan_sharding

    overrides: dict[str, Any] = {}
    for key, value in (
        ("devices.count", args.devices),
        ("devices.memory_gb", args.memory_gb),
        ("strategy", args.strategy),
        ("sharding", args.sharding),
    ):
        if value is not None:
            overrides[key] = value
    try:
        spec = load_plan_spec(args.spec, overrides=overrides)
        inputs = spec.inputs()
        if spec.disk_tier or args.disk_tier:
            inputs["tables"] = plan_disk_tier(
                inputs["tables"], inputs["devices"], num_buckets=inputs["num_buckets"]
            )
        plan = plan_sharding(**inputs)
    except (PlanSpecError, ValueError) as error:
        prefix = "refused" if isinstance(error, PlanDoesNotFit) else "error"
        print(f"{prefix}: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(plan), indent=2))
    else:
        print(format_plan(plan, inputs["tables"]))
    return 0


def _gb(value: float) -> str:
    return f"{value / GB:8.2f} GB"


def _mb(value: float) -> str:
    return f"{value / 10**6:10.1f} MB"


def format_plan(plan: ShardingPlan, tables: list[TableSize]) -> str:
    """The plan as a human-readable report."""
    kind = "PS shard" if plan.strategy == "ps" else "trainer"
    lines = [
        f"strategy {plan.strategy}, sharding {plan.sharding}, {plan.num_devices} {kind}s with "
        f"{plan.usable_bytes / GB:.2f} GB usable each, {plan.num_buckets} virtual buckets",
        "",
        f"{'device':>8} {'tables':>11} {'used':>6} {'sent/step':>13} {'received/step':>13}",
    ]
    disk = plan.disk_bytes if any(plan.disk_bytes) else ()
    if disk:
        lines[-1] += f" {'on disk':>11}"
    for device, (memory, traffic) in enumerate(zip(plan.memory_bytes, plan.traffic, strict=True)):
        lines.append(
            f"{device:>8} {_gb(memory)} {memory / plan.usable_bytes:6.1%} {_mb(traffic.sent_bytes)} "
            f"{_mb(traffic.received_bytes)}" + (f" {_gb(disk[device])}" if disk else "")
        )
    if plan.trainer_traffic is not None:
        t = plan.trainer_traffic
        lines.append(f"{'trainer':>8} {'':>11} {'':>6} {_mb(t.sent_bytes)} {_mb(t.received_bytes)}")
    lines += ["", f"{'table':<16} {'rows':>14} {'dim':>5} {'size':>11}  placement"]
    sizes = {t.name: t for t in tables}
    for placement in plan.tables:
        size = sizes[placement.table]
        where = (
            f"table-wise on device {placement.owner}"
            if placement.owner is not None
            else f"row-wise over {plan.num_devices} devices by bucket"
        )
        if size.hot_rows < size.rows:
            per_device = size.hot_rows if placement.owner is not None else size.hot_rows / plan.num_devices
            where += (
                f"; {size.hot_rows:,} rows in memory (storage.memory_rows: {math.ceil(per_device):,} per "
                f"device), {_gb(size.disk_bytes).strip()} on disk"
            )
        lines.append(f"{placement.table:<16} {size.rows:>14,} {size.dim:>5} {_gb(size.bytes)}  {where}")
    total = sum(plan.memory_bytes)
    lines += [
        "",
        f"total {total / GB:.2f} GB of tables in memory; most loaded device {max(plan.memory_bytes) / GB:.2f} GB",
    ]
    if disk:
        lines.append(f"on disk {sum(disk) / GB:.2f} GB; most loaded device {max(disk) / GB:.2f} GB")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def is_run_config(path: str) -> bool:
    """Whether `path` is a YAML run config (it has `model:`) rather than a plan file."""
    import yaml

    try:
        with open(path) as file:
            data = yaml.safe_load(file)
    except (OSError, yaml.YAMLError):
        return False  # the plan-file path reports what is wrong with it
    return isinstance(data, dict) and "model" in data


def run_stage_plan(args: argparse.Namespace) -> int:
    """`psrec plan RUN_CONFIG --memory-gb G`: the pipeline stages the run's HSTU needs."""
    from psrec.config import ConfigError, load_config
    from psrec.parallel.stage_planner import HSTUSize, StagesDoNotFit, plan_stages

    if args.memory_gb is None:
        print("error: a run config is planned for --memory-gb per device; give it", file=sys.stderr)
        return 2
    try:
        config = load_config(args.spec)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = config.model
    if model.name != "hstu":
        print(f"error: psrec plan sizes the stages of an hstu model, not {model.name!r}", file=sys.stderr)
        return 2
    pipeline = config.ps.pipeline
    negatives = {f.name: f.max_length for f in config.feature_schema().sequences}.get("negatives", 0)
    size = HSTUSize(
        embedding_dim=config.table_config("items").dim,
        max_length=model.max_length,
        num_blocks=model.num_blocks,
        num_heads=model.num_heads,
        attention_dim=model.attention_dim,
        linear_dim=model.linear_dim,
        num_negatives=negatives,
    )
    try:
        plan = plan_stages(
            size,
            memory_bytes=int(args.memory_gb * GB),
            batch_size=config.training.batch_size,
            microbatches=args.microbatches or (pipeline.microbatches if pipeline else 4),
            schedule=args.schedule or (pipeline.schedule if pipeline else "1f1b"),
        )
    except StagesDoNotFit as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(plan), "peak_bytes": plan.peak_bytes}, indent=2))
    else:
        print(format_stage_plan(plan, size, batch_size=config.training.batch_size))
    return 0


def format_stage_plan(plan: StagePlan, size: HSTUSize, *, batch_size: int) -> str:
    """The stage plan as a report; its first line is the answer."""
    from psrec.parallel.stage_planner import block_parameters

    lines = [
        f"hstu: {plan.num_stages} pipeline stage{'s' if plan.num_stages > 1 else ''} for "
        f"{plan.memory_bytes / GB:.2f} GB per device (most loaded stage {plan.peak_bytes / GB:.3f} GB)",
        f"  {size.num_blocks} blocks x {size.num_heads} heads, dqk {size.attention_dim}, dv {size.linear_dim}, "
        f"dim {size.embedding_dim}, length {size.max_length}, {size.num_negatives} negatives; "
        f"{block_parameters(size):,} parameters per block",
        f"  batch {batch_size} in {plan.microbatches} micro-batches of {plan.microbatch_sequences} "
        f"sequences, schedule {plan.schedule}; between stages {plan.bytes_between_stages_per_step / 10**6:.1f} "
        "MB per step (activations and their gradients)",
        "",
        f"{'stage':>6} {'blocks':>6} {'weights':>11} {'activations':>11} {'buffers':>11} {'total':>11}",
    ]
    for index, stage in enumerate(plan.stages):
        parts = " + embedding" if stage.parts[0] == 0 else ""
        parts += " + head" if stage.parts[1] == size.num_blocks + 2 else ""
        lines.append(
            f"{index:>6} {stage.blocks:>6} {_gb(stage.weight_bytes)} {_gb(stage.activation_bytes)} "
            f"{_gb(stage.buffer_bytes)} {_gb(stage.total_bytes)}{parts}"
        )
    lines.append("note: the item table's rows live on the parameter server, not on these devices")
    return "\n".join(lines)
