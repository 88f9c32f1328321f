"""`psrec bench`: psrec vs plain PyTorch, TorchRec, TensorFlow and the dense-only ceiling, in one invocation.

    psrec bench --dim 64 --rounds 3                        # the issue's table (a b c d e)
    psrec bench --systems a,c --steps 6 --profile          # psrec's per-phase breakdown
    psrec bench --systems psrec-ray-1x1,d,psrec-ray-2x2    # the layouts of docs/scaling.md
    psrec bench --systems psrec-ray-2x2,psrec-ray-2x2-nodes --profile   # 2x2 on one Ray node vs two
    psrec bench --json out.json --plot docs/img/throughput.png --plot-add dim16.json
    psrec bench --report out.json --profile                # print a saved report again
    psrec bench --multi-hot 8:50:variable --rows 65536     # + 8 bag features, 0-100 ids each (mean 50)
    psrec bench --multi-hot 8:50 --sparse-lr 0.005         # every system's tables at another learning rate

Systems: a pytorch + pytorch-bf16, b torchrec + torchrec-bf16, c psrec + psrec-bf16, d psrec-ray,
e ceiling + ceiling-bf16; extras: pytorch-rowwise + pytorch-bf16-rowwise (row-wise Adagrad, as psrec
and TorchRec), torchrec-fp16rows (fp16 tables, beside psrec-fp16rows), psrec-bf16-compile +
ceiling-bf16-compile (torch.compile of the dense model, `training.compile`), psrec-ray-1x1,
psrec-ray-2x2, psrec-ray-2x2-nodes (the 2x2 layout on a local cluster of two Ray nodes, one trainer
and one shard on each: `psrec.testing.local_cluster`), psrec-ray-fp16 (ps.wire_precision fp16),
psrec-ray-object-store (ps.shared_memory false: arrays through Ray's object store), psrec-bf16-grow (no expected_rows),
psrec-prepared / psrec-bf16-prepared / psrec-bf16-compile-prepared (data read as `psrec data
convert --prepared` writes it), psrec-bf16-prepared-lazy (reserved rows not populated up front:
`populate: false`), psrec-ray-t1, psrec-ray-passive, psrec-t1, psrec-passive,
pytorch-passive (PASSIVE: OMP_WAIT_POLICY=PASSIVE in the system's process), tensorflow and
tensorflow-bf16 (the DLRM in TensorFlow/Keras, fp32 and under Keras' mixed_bfloat16 policy, run by
the Python given with --tf-python; skipped without one). Every ratio is taken between equal
precisions: "x pytorch" of a bf16 system divides by pytorch-bf16, "x TF" by tensorflow-bf16, "x peer"
by the fastest of the PyTorch, TorchRec and TensorFlow systems at its precision in each round, "of
ceil" by the dense-only ceiling at the system's settings (bf16 by ceiling-bf16, compiled by the
compiled one); only "x fp32*" crosses precisions (over the same system in fp32) and says so.

Multi-hot (--multi-hot FEATURES:POOLING[:fixed|variable]): FEATURES more sparse features M1..Mk after
Criteo's 26, each a bag of POOLING ids per sample ("fixed", the default) or of a uniform number in
[0, 2 x POOLING] ("variable": empty bags included); ids are integers (no hashing) and every system
sum-pools the same bags (EmbeddingBag, TorchRec's fused TBE, psrec's bag kernel, TensorFlow's
segment sums). Bags hold many ids: lower --rows (every run loads its batches) to what the steps need.

Device (--device auto|cpu|cuda, default auto: cuda when this machine has a CUDA device): plain
PyTorch, the ceiling and psrec's trainers train on it (psrec's rows stay on its shards, in host
memory; Ray layouts with more trainers than GPUs stay on the CPU); TorchRec and TensorFlow run on the
CPU. The table's header and its device column say where each system ran.

Memory: beside samples/s, the median over rounds of each run's peak RSS (every run is a fresh
process; a Ray system adds its actors' peaks) and "RSS x trec", its median within-round ratio to
TorchRec at the same precision; --json also keeps each run's peak, the ratio to plain PyTorch and the
peak before evaluation (`training_peak_rss_bytes`; the evaluation batch, 16384 rows, usually sets the
peak). Each system's process runs with the CLI's malloc settings (`psrec.allocator`);
PSREC_MALLOC_TUNING=0 runs every system with glibc's defaults instead.

Machine: the header names the CPU model, its ISA features that decide bf16's speed (avx2, avx512f,
avx512_bf16, avx512_vnni, amx_bf16, amx_int8, amx_tile; `psrec.machine`), the cores and the load
average at the start and end. bf16 systems on a CPU without native bf16 (neither avx512_bf16 nor
amx_bf16) or a GPU without it run emulated, slower than fp32: the bench warns before the runs and
under the table (psrec's own default, `training.dense_precision: auto`, trains in fp32 there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from psrec.bench.systems import DEFAULT_SYSTEMS, SYSTEMS
from psrec.bench.workload import Workload, parse_multi_hot
from psrec.machine import EMULATED_BF16_COST, ISA_FEATURES, isa_features, native_bf16


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark psrec against plain PyTorch, TorchRec, TensorFlow and the dense-only ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dim", type=int, choices=(64, 16), default=64, help="embedding dim")
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic training rows generated")
    parser.add_argument("--validation-rows", type=int, default=50_000, help="held-out rows for the AUC")
    parser.add_argument("--cardinality-scale", type=float, default=0.05, help="x Criteo Kaggle cardinalities")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each system")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the dense models train (auto: cuda when this machine has a CUDA device)",
    )
    parser.add_argument(
        "--sparse-lr",
        type=_positive,
        default=Workload.sparse_lr,
        help="row-wise Adagrad learning rate of every system's tables",
    )
    parser.add_argument(
        "--multi-hot",
        metavar="FEATURES:POOLING[:fixed|variable]",
        type=_multi_hot,
        help="add FEATURES bag features of POOLING ids each (fixed) or 0..2*POOLING ids (variable), "
        "e.g. 8:50:variable",
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated: letters a-e or names ({', '.join(SYSTEMS)})",
    )
    parser.add_argument("--json", help="write the full report (every run) here")
    parser.add_argument("--profile", action="store_true", help="print psrec's per-phase step breakdown")
    parser.add_argument("--plot", help="write the throughput figure here (needs matplotlib)")
    parser.add_argument("--plot-add", nargs="*", default=[], help="earlier --json reports to plot alongside")
    parser.add_argument(
        "--tf-python",
        help="Python of an environment with TensorFlow for the 'tensorflow' systems "
        "(sets PSREC_BENCH_TF_PYTHON; e.g. /tmp/tfvenv/bin/python)",
    )
    parser.add_argument("--no-isolate", action="store_true", help="run systems in this process (debugging)")
    parser.add_argument("--report", help="do not run: print (and --plot) a saved --json report")
    parser.set_defaults(func=run)


def _positive(text: str) -> float:
    """A learning rate: a number > 0, or argparse's error naming the value."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _multi_hot(spec: str) -> tuple[int, int, str]:
    """--multi-hot's value, or argparse's error naming the option and the expected form."""
    try:
        return parse_multi_hot(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def bench_device(setting: str) -> str:
    """--device as the workload's "cpu" or "cuda"; ValueError for cuda on a machine without one."""
    import torch

    if setting == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if setting == "cuda" and not available:
        raise ValueError(
            "--device cuda: this machine has no CUDA device (or torch is a CPU build); use --device cpu or auto"
        )
    return "cuda" if available else "cpu"


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The `Workload` of a `psrec bench` command line."""
    multi_hot = args.multi_hot or (0, 1, "fixed")
    return Workload(
        dim=args.dim,
        batch_size=args.batch_size,
        train_rows=args.rows,
        validation_rows=args.validation_rows,
        cardinality_scale=args.cardinality_scale,
        warmup_steps=args.warmup,
        steps=args.steps,
        threads=args.threads,
        sparse_lr=args.sparse_lr,
        multi_hot_features=multi_hot[0],
        pooling_factor=multi_hot[1],
        bag_lengths=multi_hot[2],
        device=bench_device(getattr(args, "device", "auto")),
    )


def run(args: argparse.Namespace) -> int:
    from psrec.bench.harness import machine_description, run_bench
    from psrec.bench.tf_system import PYTHON_VARIABLE

    if args.tf_python:
        os.environ[PYTHON_VARIABLE] = args.tf_python  # the isolated system processes inherit it

    try:
        workload = workload_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    if not args.report:
        print(machine_line(machine_description()), flush=True)
        warning = planned_emulation_warning(args.systems, workload)
        if warning:
            print(warning, flush=True)

    def progress(round_index: int, result: dict[str, Any]) -> None:
        if "samples_per_second" in result:
            shown = f"{result['samples_per_second']:9.0f} samples/s {_gigabytes(result.get('peak_rss_bytes'))} peak RSS"
        else:
            shown = result.get("skipped") or result.get("error", "?")
        print(f"round {round_index} {result['system']:20s} {shown}", flush=True)

    if args.report:
        report = json.loads(Path(args.report).read_text())
    else:
        report = run_bench(
            workload, args.systems, rounds=args.rounds, isolate=not args.no_isolate, progress=progress
        )
    print()
    print(format_table(report))
    if args.profile:
        print()
        print(format_profile(report))
    if args.json and not args.report:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))
        print(f"\nwrote {args.json}")
    if args.plot:
        from psrec.bench.plot import plot_throughput

        reports = [report] + [json.loads(Path(p).read_text()) for p in args.plot_add]
        print(f"wrote {plot_throughput(reports, args.plot)}")
    return 0


def _number(value: float | None, spec: str) -> str:
    """`value` formatted with `spec` ("9.2f"); "-" at the same width when there is none."""
    return format("-", f">{spec.split('.')[0]}") if value is None else format(value, spec)


def _gigabytes(value: float | None) -> str:
    """Bytes as GiB with two decimals ("1.52G"), "-" when there is none; 8 characters wide."""
    return f"{'-' if not value else format(value / 2**30, '.2f') + 'G':>8s}"


def format_table(report: dict[str, Any]) -> str:
    """The bench's table: every ratio between equal precisions, except "x fp32*", which is marked."""
    workload, machine = report["workload"], report["machine"]
    sparse = Workload(**workload).describe()
    lines = [
        f"DLRM dim {workload['dim']}, {sparse} sparse features, batch {workload['batch_size']}, "
        f"{workload['threads']} threads, "
        f"{workload['steps']} timed steps after {workload['warmup_steps']}, {report['rounds']} rounds; "
        f"device {workload.get('device', 'cpu')}"
        + (f" ({machine['gpu']})" if machine.get("gpu") and workload.get("device") == "cuda" else "")
        + f"; {_cpu(machine)} ({machine['cores']} cores), load {machine['load_average'][0]:.2f} at start"
        + (f", {machine['load_average_end'][0]:.2f} at end" if "load_average_end" in machine else ""),
        "wall: median samples/s and within-round ratios, each to the system of that kind at the same "
        "precision ('-': none ran; x TF: to TensorFlow; x peer: to the fastest of PyTorch, TorchRec "
        "and TensorFlow in each round; of ceil: to the ceiling at the same precision and compile); "
        "x fp32*: CROSS-PRECISION, over the same system in fp32; cpu: samples per CPU-second (all "
        "threads and processes) and its ratios; best: fastest step (psrec: warm-up-sized chunk) of all "
        "rounds; val AUC: every embedding system gives each id its own row; peak RSS: median over "
        "rounds of each run's peak resident memory (Ray: driver + actors), RSS x trec: its median "
        "within-round ratio to TorchRec at the same precision",
        f"{'system':20s} {'precision':15s} {'samples/s':>9s} {'peak RSS':>8s} {'RSS x trec':>10s} "
        f"{'x pytorch':>9s} {'x torchrec':>10s} "
        f"{'x TF':>6s} {'x peer':>6s} {'of ceil':>7s} {'x psrec':>7s} {'x fp32*':>7s} "
        f"{'cpu smp/s':>9s} {'x pytorch':>9s} {'x TF':>6s} {'x peer':>6s} {'of ceil':>7s} {'best':>7s} "
        f"{'val AUC':>7s} {'device':6s} status",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['system']:20s} {row.get('precision', '?'):15s} {_number(row['samples_per_second'], '9.0f')} "
            f"{_gigabytes(row['peak_rss_bytes'])} {_number(row.get('rss_ratio_to_torchrec'), '10.2f')} "
            f"{_number(row['ratio_to_pytorch'], '9.2f')} {_number(row.get('ratio_to_torchrec'), '10.2f')} "
            f"{_number(row.get('ratio_to_tensorflow'), '6.2f')} {_number(row.get('ratio_to_best_peer'), '6.2f')} "
            f"{_number(row['fraction_of_ceiling'], '7.2f')} {_number(row['ratio_to_psrec'], '7.2f')} "
            f"{_cross(row.get('ratio_to_fp32'))} "
            f"{_number(row.get('samples_per_cpu_second'), '9.0f')} "
            f"{_number(row.get('cpu_ratio_to_pytorch'), '9.2f')} "
            f"{_number(row.get('cpu_ratio_to_tensorflow'), '6.2f')} "
            f"{_number(row.get('cpu_ratio_to_best_peer'), '6.2f')} "
            f"{_number(row.get('cpu_fraction_of_ceiling'), '7.2f')} "
            f"{_number(row.get('best_step_samples_per_second'), '7.0f')} {_number(row['auc'], '7.4f')} "
            f"{row.get('device') or '-':6s} {row['status']}"
        )
    emulated = emulated_bf16_systems(report)
    if emulated:
        lines.append(_emulation_warning(emulated))
    return "\n".join(lines)


def _features(machine: dict[str, Any]) -> list[str]:
    """The machine's ISA features (reports written before they were named: its listed CPU flags)."""
    return list(machine.get("isa_features", machine.get("cpu_flags", [])))


def _cpu(machine: dict[str, Any]) -> str:
    """The CPU model and its ISA features: "AMD EPYC [avx2 avx512f avx512_bf16]"."""
    return f"{machine['cpu']} [{' '.join(_features(machine)) or 'none of ' + ', '.join(ISA_FEATURES)}]"


def machine_line(machine: dict[str, Any]) -> str:
    """What the bench prints before it runs: the CPU, its ISA features, cores, load and the GPU."""
    load = ", ".join(f"{value:.2f}" for value in machine["load_average"])
    gpu = f"; GPU {machine['gpu']}" if machine.get("gpu") else ""
    return f"machine: {_cpu(machine)}, {machine['cores']} cores, load average {load}{gpu}"


def emulated_bf16_systems(report: dict[str, Any]) -> list[str]:
    """The bf16 systems of `report` that ran where bf16 is emulated: on a CPU without native bf16
    (neither avx512_bf16 nor amx_bf16), or on a GPU without it."""
    machine = report["machine"]
    emulated = []
    for row in report["rows"]:
        if not str(row.get("precision", "")).startswith("bf16") or row.get("samples_per_second") is None:
            continue
        on_gpu = row.get("device") == "cuda"
        if not (bool(machine.get("gpu_bf16")) if on_gpu else native_bf16(_features(machine))):
            emulated.append(str(row["system"]))
    return emulated


def _emulation_warning(systems: list[str]) -> str:
    return (
        f"warning: bf16 runs emulated here ({', '.join(systems)}): no native bf16 on this device, so "
        f"expect these slower than fp32 ({EMULATED_BF16_COST}); psrec's default dense_precision auto "
        "trains in fp32 here"
    )


def planned_emulation_warning(systems: str, workload: Workload) -> str | None:
    """The warning for the bf16 systems about to run on a CPU without native bf16 (None: none)."""
    from psrec.bench.systems import resolve_systems

    if workload.device != "cpu" or native_bf16(isa_features()):
        return None
    try:
        names = resolve_systems(systems)
    except ValueError:  # run_bench says what is wrong
        return None
    bf16 = [name for name in names if SYSTEMS[name].dense_precision.startswith("bf16")]
    return _emulation_warning(bf16) if bf16 else None


def _cross(value: float | None) -> str:
    """A cross-precision ratio, marked with '*' (see the table's legend)."""
    return f"{'-':>7s}" if value is None else f"{value:6.2f}*"


PHASES = (
    "plan",
    "pull",
    "forward",
    "backward",
    "push",
    "allreduce",
    "optimizer",
    "other",
    "total",
    "plan_overlapped",
)


def format_profile(report: dict[str, Any]) -> str:
    """psrec's milliseconds per step by phase (last round), and bytes on the wire per sample."""
    rows = [row for row in report["rows"] if "profile" in row]
    if not rows:
        return "no psrec system ran: nothing to profile"
    lines = [
        "psrec per-step phases, ms (last round, timed steps; 'plan' = waiting for the next batch, read and "
        "planned meanwhile; 'plan_overlapped' = the planner's own time; 'other' = driver between phases and "
        "between chunks; forward includes pooling); 1st step s: median seconds from the train() call to the "
        "end of the first step (Ray: the cluster is up before the call)",
        f"{'system':20s} "
        + " ".join(f"{p:>9s}" for p in PHASES)
        + f" {'pullB/smp':>9s} {'pushB/smp':>9s} {'1st step s':>10s}",
    ]
    for row in rows:
        profile = row["profile"]
        cells = " ".join(f"{profile.get(p, 0.0):9.1f}" for p in PHASES)
        lines.append(
            f"{row['system']:20s} {cells} {row['bytes_pulled_per_sample']:9.0f} {row['bytes_pushed_per_sample']:9.0f} "
            f"{_number(row.get('seconds_to_first_step'), '10.2f')}"
        )
    spanning = [row for row in rows if row.get("placement", {}).get("nodes_alive", 1) > 1]
    if spanning:
        from psrec.cluster.placement import describe

        lines.append("")
        lines += [f"{row['system']}: {describe(row['placement'])}" for row in spanning]
    return "\n".join(lines)
