"""A first-order throughput model for psrec with N trainers x M shards (see docs/scaling.md).

Inputs are what `psrec bench` measures (`StepCosts.from_runs`): the in-process run's per-phase
times and CPU cost per sample, the bytes pulled/pushed per sample, and a Ray run's extra time and CPU
per step. A sync step of one trainer (batch b) then costs

    T = t_trainer                                   # plan + forward + backward + optimizer + other
      + 2 * t_rpc                                   # pull and push round trips (Ray), fixed per step
      + max(1, N / M) * b * (p + q) / W             # rows + gradients on the busiest NIC (trainer or shard)
      + N * b * c_shard / M                          # the shard's lookup + optimizer work, N trainers' worth
      + 2 (N - 1) / N * 4 P / W                      # ring allreduce of P dense fp32 parameters
    X_dedicated = N * b / T                          # samples/s, every process on its own cores

with W the per-process network bandwidth (bytes/s). With `rpc_queued`, the round trips cost
2 * t_rpc * max(1, N / M) instead: all of a call's Ray overhead is taken to be the shard's, whose
single thread serves its N / M trainers' calls one after another (a lower bound on X). On one machine
whose C cores all processes share, the job is also bounded by its CPU work: X <= C *
samples_per_cpu_second, where a Ray layout's CPU per sample is the in-process one plus the Ray
overhead measured on the 1x2 layout; the prediction is the smaller of the two bounds.

From a saved bench report (`psrec bench --json`), the module prints the measured inputs, the check
of every Ray layout the report holds against the model, and the predictions for a cluster:

    python -m psrec.bench.throughput_model docs/data/scaling.json
    python -m psrec.bench.throughput_model report.json --layouts 8x4,32x16,128x64 --gbps 10,100 --cores 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

INFINITE_BANDWIDTH = float("inf")
BYTES_PER_GBIT = 1e9 / 8  # W in bytes/s of a link of 1 Gb/s


@dataclass(frozen=True)
class StepCosts:
    batch_size: int
    trainer_seconds: float  # per step, trainer-side work (in-process run, minus shard work)
    shard_seconds_per_sample: float  # shard CPU (lookup + insert + optimizer) per sample
    rpc_seconds: float  # extra per remote call (pull or push) on Ray, per step
    bytes_pulled_per_sample: float
    bytes_pushed_per_sample: float
    dense_parameters: int
    cpu_seconds_per_sample: float  # in-process, all threads
    ray_cpu_seconds_per_sample: float  # extra CPU per sample on Ray (serialisation, actors)

    @staticmethod
    def from_runs(
        local: dict[str, Any], ray: dict[str, Any], *, batch_size: int, dense_parameters: int
    ) -> StepCosts:
        """From bench rows of the in-process system and the Ray 1x2 system (same workload)."""
        local_ms, ray_ms = local["profile"], ray["profile"]
        shard_ms = local_ms.get("pull", 0.0) + local_ms.get("push", 0.0)
        rpc_ms = max(0.0, (ray_ms.get("pull", 0.0) + ray_ms.get("push", 0.0) - shard_ms) / 2)
        local_cpu = 1.0 / local["samples_per_cpu_second"]
        ray_cpu = 1.0 / ray["samples_per_cpu_second"]
        return StepCosts(
            batch_size=batch_size,
            trainer_seconds=(local_ms["total"] - shard_ms) / 1000,
            shard_seconds_per_sample=shard_ms / 1000 / batch_size,
            rpc_seconds=rpc_ms / 1000,
            bytes_pulled_per_sample=local["bytes_pulled_per_sample"],
            bytes_pushed_per_sample=local["bytes_pushed_per_sample"],
            dense_parameters=dense_parameters,
            cpu_seconds_per_sample=local_cpu,
            ray_cpu_seconds_per_sample=max(0.0, ray_cpu - local_cpu),
        )


def step_seconds(
    costs: StepCosts,
    *,
    trainers: int,
    shards: int,
    bandwidth: float,
    remote: bool = True,
    rpc_queued: bool = False,
) -> float:
    """T of the module docstring: one sync step of one trainer, every process on its own cores."""
    b = costs.batch_size
    load = max(1.0, trainers / shards)  # trainers one shard serves
    # A trainer's NIC carries its own rows; a shard's carries N/M trainers' worth.
    wire = load * b * (costs.bytes_pulled_per_sample + costs.bytes_pushed_per_sample) / bandwidth
    shard = trainers * b * costs.shard_seconds_per_sample / shards
    allreduce = 2 * (trainers - 1) / trainers * 4 * costs.dense_parameters / bandwidth
    rpc = 2 * costs.rpc_seconds * (load if rpc_queued else 1.0) if remote else 0.0
    return costs.trainer_seconds + rpc + wire + shard + allreduce


def predict(
    costs: StepCosts,
    *,
    trainers: int,
    shards: int,
    bandwidth: float = INFINITE_BANDWIDTH,
    shared_cores: float | None = None,
    remote: bool = True,
    rpc_queued: bool = False,
) -> dict[str, float]:
    """Predicted samples/s: dedicated-cores bound, shared-machine CPU bound (if `shared_cores`), and the min."""
    seconds = step_seconds(
        costs, trainers=trainers, shards=shards, bandwidth=bandwidth, remote=remote, rpc_queued=rpc_queued
    )
    dedicated = trainers * costs.batch_size / seconds
    out = {"dedicated": dedicated, "predicted": dedicated}
    if shared_cores is not None:
        cpu = costs.cpu_seconds_per_sample + (costs.ray_cpu_seconds_per_sample if remote else 0.0)
        out["cpu_bound"] = shared_cores / cpu
        out["predicted"] = min(dedicated, out["cpu_bound"])
    return out


@dataclass(frozen=True)
class Layout:
    """A Ray layout `psrec bench` runs, and the bench systems whose rows give its model inputs."""

    system: str
    trainers: int
    shards: int
    local: str  # in-process system with the same trainer threads: t_trainer, c_shard, CPU per sample
    ray: str  # Ray 1x2 system with the same trainer threads: t_rpc and the Ray CPU overhead


CHECKED_LAYOUTS = (
    Layout("psrec-ray-1x1", 1, 1, "psrec", "psrec-ray"),
    Layout("psrec-ray", 1, 2, "psrec", "psrec-ray"),
    Layout("psrec-ray-t1", 1, 2, "psrec-t1", "psrec-ray-t1"),
    Layout("psrec-ray-2x2", 2, 2, "psrec-t1", "psrec-ray-t1"),
    Layout("psrec-ray-2x2-nodes", 2, 2, "psrec-t1", "psrec-ray-t1"),
)
CLUSTER_INPUTS = ("psrec", "psrec-ray")  # the cluster predictions' trainer: 2 threads, as measured
WIRE_SYSTEM = "psrec-ray-2x2-nodes"  # whose bytes per sample the predictions use when it ran
DEFAULT_LAYOUTS = ((1, 1), (2, 2), (4, 2), (8, 4), (8, 2), (16, 8), (32, 16), (32, 8), (128, 64), (128, 32))
DEFAULT_GBPS = (1.0, 10.0, 25.0, 100.0)
QUEUED_GBPS = (10.0, 100.0)  # the rpc_queued lower bound is shown at these


def dense_parameters(workload: dict[str, Any]) -> int:
    """P: the bench DLRM's dense parameters for a report's workload."""
    from psrec.bench.workload import Workload, build_dlrm

    return sum(parameter.numel() for parameter in build_dlrm(Workload(**workload)).parameters())


def report_rows(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """System -> row of every system that ran, over several reports of one workload (later win)."""
    workloads = {json.dumps(report["workload"], sort_keys=True) for report in reports}
    if len(workloads) > 1:
        raise ValueError("the reports ran different workloads; the model needs one")
    return {
        row["system"]: row
        for report in reports
        for row in report["rows"]
        if row.get("samples_per_second") and "profile" in row
    }


def layout_costs(
    rows: dict[str, dict[str, Any]], local: str, ray: str, *, workload: dict[str, Any], parameters: int
) -> StepCosts | None:
    """The model inputs from the rows of `local` and `ray`; None unless both ran."""
    if local not in rows or ray not in rows:
        return None
    return StepCosts.from_runs(
        rows[local], rows[ray], batch_size=int(workload["batch_size"]), dense_parameters=parameters
    )


def check(
    rows: dict[str, dict[str, Any]], *, workload: dict[str, Any], parameters: int, cores: float
) -> list[dict[str, Any]]:
    """Each Ray layout that ran (with its inputs): measured samples/s and per CPU-second, the model on
    its own cores (loopback: infinite bandwidth) and on `cores` shared cores, the bytes per sample,
    and the CPU per sample of Ray's own processes (raylets, GCS; not in the CPU-second figure)."""
    out = []
    for layout in CHECKED_LAYOUTS:
        costs = layout_costs(rows, layout.local, layout.ray, workload=workload, parameters=parameters)
        if layout.system not in rows or costs is None:
            continue
        row = rows[layout.system]
        model = predict(costs, trainers=layout.trainers, shards=layout.shards, shared_cores=cores)
        out.append(
            {
                "system": layout.system,
                "inputs": f"{layout.local} + {layout.ray}",
                "measured": float(row["samples_per_second"]),
                "cpu": float(row["samples_per_cpu_second"]),
                "own_cores": model["dedicated"],
                "shared_cores": model["cpu_bound"],
                "bytes_pulled_per_sample": float(row["bytes_pulled_per_sample"]),
                "bytes_pushed_per_sample": float(row["bytes_pushed_per_sample"]),
                "nodes": (row.get("placement") or {}).get("nodes_used", 1),
                "ray_daemons_cpu_seconds_per_sample": row.get("ray_daemons_cpu_seconds_per_sample"),
            }
        )
    return out


def cluster_costs(rows: dict[str, dict[str, Any]], *, workload: dict[str, Any], parameters: int) -> StepCosts:
    """The cluster predictions' inputs: `CLUSTER_INPUTS`, with the bytes per sample of the across-nodes
    run when the report holds it (the bytes that crossed Ray's wire; in process they are counted alike)."""
    costs = layout_costs(rows, *CLUSTER_INPUTS, workload=workload, parameters=parameters)
    if costs is None:
        raise ValueError(f"the report lacks {' or '.join(CLUSTER_INPUTS)}: no inputs for the model")
    if WIRE_SYSTEM in rows:
        wire = rows[WIRE_SYSTEM]
        costs = replace(
            costs,
            bytes_pulled_per_sample=float(wire["bytes_pulled_per_sample"]),
            bytes_pushed_per_sample=float(wire["bytes_pushed_per_sample"]),
        )
    return costs


def prediction_table(
    costs: StepCosts,
    layouts: Sequence[tuple[int, int]] = DEFAULT_LAYOUTS,
    gbps: Sequence[float] = DEFAULT_GBPS,
    queued_gbps: Sequence[float] = QUEUED_GBPS,
) -> list[dict[str, Any]]:
    """Per layout (N, M): samples/s on own cores at each link speed, and the rpc-queued lower bound."""
    table = []
    for trainers, shards in layouts:

        def rate(speed: float, queued: bool, trainers: int = trainers, shards: int = shards) -> float:
            bandwidth = speed * BYTES_PER_GBIT
            return predict(costs, trainers=trainers, shards=shards, bandwidth=bandwidth, rpc_queued=queued)[
                "dedicated"
            ]

        table.append(
            {
                "trainers": trainers,
                "shards": shards,
                "samples_per_second": {speed: rate(speed, False) for speed in gbps},
                "queued": {speed: rate(speed, True) for speed in queued_gbps},
            }
        )
    return table


def rate_text(value: float) -> str:
    """Samples/s to three significant figures: 946, 24.4k, 265k, 1.83M."""
    if value < 999.5:
        return f"{value:.0f}"
    scaled, unit = (value / 1e6, "M") if value >= 999_500 else (value / 1e3, "k")
    digits = 2 if scaled < 9.995 else 1 if scaled < 99.95 else 0
    return f"{scaled:.{digits}f}{unit}"


def _gbps_text(speed: float) -> str:
    return f"{speed:g} Gb/s"


def format_inputs(costs: StepCosts) -> str:
    lines = [
        "| quantity | value |",
        "|---|---|",
        f"| bytes pulled per sample, p | {costs.bytes_pulled_per_sample:.0f} B |",
        f"| bytes pushed per sample, q | {costs.bytes_pushed_per_sample:.0f} B |",
        f"| per trainer step on the wire, b (p + q) | "
        f"{costs.batch_size * (costs.bytes_pulled_per_sample + costs.bytes_pushed_per_sample) / 1e6:.1f} MB |",
        f"| t_trainer | {1000 * costs.trainer_seconds:.1f} ms |",
        f"| c_shard | {1e6 * costs.shard_seconds_per_sample:.2f} us/sample "
        f"({1000 * costs.shard_seconds_per_sample * costs.batch_size:.1f} ms/step) |",
        f"| t_rpc | {1000 * costs.rpc_seconds:.1f} ms per call |",
        f"| P | {costs.dense_parameters:,} ({4 * costs.dense_parameters / 1e6:.1f} MB fp32) |",
        f"| CPU per sample, in-process | {1e6 * costs.cpu_seconds_per_sample:.1f} us |",
        f"| Ray CPU overhead per sample | {1e6 * costs.ray_cpu_seconds_per_sample:.1f} us |",
    ]
    return "\n".join(lines)


def format_check(checked: list[dict[str, Any]], cores: float) -> str:
    lines = [
        f"| layout | Ray nodes | measured samples/s | model, own cores | model, {cores:g} shared cores "
        "| measured samples per CPU-s | raylets + GCS, CPU us/smp | cores busy | pullB/smp | pushB/smp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in checked:
        measured = entry["measured"]
        daemons = entry["ray_daemons_cpu_seconds_per_sample"]
        busy = measured * (1 / entry["cpu"] + (daemons or 0.0))  # psrec's processes and Ray's own
        lines.append(
            f"| `{entry['system']}` | {entry['nodes']} | {measured:,.0f} "
            f"| {entry['own_cores']:,.0f} ({measured / entry['own_cores'] - 1:+.0%}) "
            f"| {entry['shared_cores']:,.0f} ({measured / entry['shared_cores'] - 1:+.0%}) "
            f"| {entry['cpu']:,.0f} | {'-' if daemons is None else format(1e6 * daemons, '.1f')} "
            f"| {busy:.2f} | {entry['bytes_pulled_per_sample']:.0f} "
            f"| {entry['bytes_pushed_per_sample']:.0f} |"
        )
    return "\n".join(lines)


def format_predictions(table: list[dict[str, Any]]) -> str:
    """The prediction table as docs/scaling.md shows it (markdown)."""
    speeds = list(table[0]["samples_per_second"]) if table else []
    queued = list(table[0]["queued"]) if table else []
    header = ["layout N x M", *map(_gbps_text, speeds), *(f"{_gbps_text(s)}, rpc queued" for s in queued)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in table:
        cells = [
            f"{entry['trainers']} x {entry['shards']}",
            *(rate_text(entry["samples_per_second"][s]) for s in speeds),
            *(rate_text(entry["queued"][s]) for s in queued),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_report(
    reports: list[dict[str, Any]],
    cores: float,
    layouts: Sequence[tuple[int, int]],
    gbps: Sequence[float],
    queued_gbps: Sequence[float],
) -> str:
    """The text `main` prints: the model's inputs, its check against the measured layouts (when the
    reports hold them) and the cluster predictions."""
    rows = report_rows(reports)
    workload = reports[0]["workload"]
    parameters = dense_parameters(workload)
    costs = cluster_costs(rows, workload=workload, parameters=parameters)
    wire = WIRE_SYSTEM if WIRE_SYSTEM in rows else CLUSTER_INPUTS[0]
    parts = [
        f"Inputs ({' + '.join(CLUSTER_INPUTS)}; bytes per sample from {wire}):\n",
        format_inputs(costs) + "\n",
    ]
    checked = check(rows, workload=workload, parameters=parameters, cores=cores)
    if checked:
        inputs = "; ".join(f"{entry['system']}: {entry['inputs']}" for entry in checked)
        parts += [
            f"Check against the measured layouts (model inputs per layout: {inputs}):\n",
            format_check(checked, cores) + "\n",
        ]
    table = prediction_table(costs, list(layouts), list(gbps), list(queued_gbps))
    parts += ["Predictions, every process on its own cores:\n", format_predictions(table)]
    return "\n".join(parts)


def _layouts(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(n) for n in part.lower().split("x")) for part in text.split(",") if part]
    except ValueError:
        pairs = []
    if not pairs or any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected layouts like 8x4,32x16, got {text!r}")
    return [(pair[0], pair[1]) for pair in pairs]


def _speeds(text: str) -> list[float]:
    try:
        speeds = [float(part) for part in text.split(",") if part]
    except ValueError:
        speeds = []
    if not speeds or min(speeds) <= 0:
        raise argparse.ArgumentTypeError(f"expected link speeds in Gb/s like 10,100, got {text!r}")
    return speeds


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m psrec.bench.throughput_model`: the scaling model's report of `psrec bench --json` reports."""
    parser = argparse.ArgumentParser(
        prog="python -m psrec.bench.throughput_model",
        description="The scaling model's inputs, check and cluster predictions from `psrec bench --json` reports.",
    )
    parser.add_argument("reports", nargs="+", help="bench reports (--json) of one workload")
    parser.add_argument("--cores", type=float, default=2.0, help="cores the measured layouts shared")
    parser.add_argument("--layouts", type=_layouts, default=list(DEFAULT_LAYOUTS), help="e.g. 8x4,32x16")
    parser.add_argument("--gbps", type=_speeds, default=list(DEFAULT_GBPS), help="link speeds, Gb/s")
    parser.add_argument(
        "--queued-gbps",
        type=_speeds,
        default=list(QUEUED_GBPS),
        help="link speeds of the rpc-queued bound",
    )
    args = parser.parse_args(argv)
    reports = [json.loads(Path(path).read_text()) for path in args.reports]
    print(scaling_report(reports, args.cores, args.layouts, args.gbps, args.queued_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
