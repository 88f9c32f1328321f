"""The systems `psrec bench` can run: each one's name, label, runner, precision and ceiling, the
baselines its ratios divide by at the same precision, and the letters a-e of the issue's table.

    from psrec.bench.systems import SYSTEMS, resolve_systems
    resolve_systems("a,psrec-ray")  # ['pytorch', 'pytorch-bf16', 'psrec-ray']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from psrec.bench import psrec_systems, tf_system, torch_systems
from psrec.bench.psrec_systems import PsrecLayout, PsrecOptions
from psrec.bench.workload import Workload

CEILING = "ceiling"


PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # OpenMP threads sleep instead of spinning when idle


@dataclass(frozen=True)
class System:
    name: str
    label: str
    run: Callable[[Workload, dict[str, Any]], dict[str, Any]]
    # Environment of the system's process (isolated runs only: OpenMP reads it when torch loads).
    env: tuple[tuple[str, str], ...] = ()
    # The dense-only ceiling at the same settings (precision, compile): "of ceil" divides by it.
    ceiling: str = CEILING
    # The numbers it computes in: the dense model's precision, then any reduced storage or wire
    # ("fp32", "bf16", "fp32, fp16 rows"). Ratios to PyTorch, TorchRec and psrec are taken only
    # between systems of equal precision (`REFERENCES`).
    precision: str = "fp32"
    # The same system in fp32 throughout: "x fp32", the one figure that crosses precisions.
    fp32_twin: str | None = None

    @property
    def dense_precision(self) -> str:
        return self.precision.split(",")[0]


def _in_process(
    name: str,
    label: str,
    ceiling: str = CEILING,
    *,
    options: PsrecOptions | None = None,
    fp32_twin: str | None = None,
) -> System:
    """A psrec system on the in-process runtime with 1 local shard, trained with `options`."""
    run = partial(psrec_systems.run_psrec, layout=PsrecLayout("local", num_shards=1), options=options)
    return System(
        name,
        label,
        run,
        ceiling=ceiling,
        precision=_precision(options or PsrecOptions()),
        fp32_twin=fp32_twin,
    )


def _precision(options: PsrecOptions) -> str:
    """`System.precision` of a psrec system: the dense precision, then reduced rows or wire."""
    parts = [options.dense_precision]
    if options.row_precision != "fp32":
        parts.append(f"{options.row_precision} rows")
    if options.wire_precision != "fp32":
        parts.append(f"{options.wire_precision} wire")
    return ", ".join(parts)


_SYSTEMS = [
    System("pytorch", "(a) plain PyTorch (EmbeddingBag + Adagrad)", torch_systems.run_pytorch),
    System(
        "pytorch-bf16",
        "(a) plain PyTorch, bf16 autocast",
        partial(torch_systems.run_pytorch, bf16=True),
        ceiling="ceiling-bf16",
        precision="bf16",
        fp32_twin="pytorch",
    ),
    System(
        "pytorch-rowwise",
        "(a) plain PyTorch, row-wise Adagrad (as psrec and TorchRec)",
        partial(torch_systems.run_pytorch, rowwise=True),
    ),
    System(
        "pytorch-bf16-rowwise",
        "(a) plain PyTorch, bf16 autocast, row-wise Adagrad",
        partial(torch_systems.run_pytorch, bf16=True, rowwise=True),
        ceiling="ceiling-bf16",
        precision="bf16",
        fp32_twin="pytorch-rowwise",
    ),
    System("torchrec", "(b) TorchRec fused EBC, row-wise Adagrad", torch_systems.run_torchrec),
    System(
        "torchrec-bf16",
        "(b) TorchRec fused EBC, bf16 autocast (fp32 tables)",
        partial(torch_systems.run_torchrec, bf16=True),
        ceiling="ceiling-bf16",
        precision="bf16",
        fp32_twin="torchrec",
    ),
    System(
        "torchrec-fp16rows",
        "(b) TorchRec fused EBC, fp16 tables (data_type FP16)",
        partial(torch_systems.run_torchrec, fp16_rows=True),
        precision="fp32, fp16 rows",
        fp32_twin="torchrec",
    ),
    _in_process("psrec", "(c) psrec in-process (1 local shard)"),
    System(
        "psrec-ray",
        "(d) psrec Ray 1 trainer + 2 shards",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray")),
    ),
    _in_process(
        "psrec-bf16",
        "(c) psrec in-process, bf16 dense",
        "ceiling-bf16",
        options=PsrecOptions(dense_precision="bf16"),
        fp32_twin="psrec",
    ),
    _in_process(
        "psrec-compile",
        "(c) psrec in-process fp32, torch.compile",
        "ceiling-compile",
        options=PsrecOptions(compile_model=True),
    ),
    _in_process(
        "psrec-bf16-compile",
        "(c) psrec in-process, bf16 dense, torch.compile",
        "ceiling-bf16-compile",
        options=PsrecOptions(dense_precision="bf16", compile_model=True),
    ),
    _in_process(
        "psrec-bf16-cached",
        "(c) psrec in-process, bf16 dense, rows in memory (cache_data, epoch 2)",
        "ceiling-bf16",
        options=PsrecOptions(dense_precision="bf16", cache_data=True),
        fp32_twin="psrec-cached",
    ),
    _in_process(
        "psrec-bf16-compile-cached",
        "(c) psrec in-process, bf16 dense, torch.compile, rows in memory (cache_data, epoch 2)",
        "ceiling-bf16-compile",
        options=PsrecOptions(dense_precision="bf16", compile_model=True, cache_data=True),
    ),
    _in_process(
        "psrec-cached",
        "(c) psrec in-process fp32, rows in memory (cache_data, epoch 2)",
        options=PsrecOptions(cache_data=True),
    ),
    _in_process(
        "psrec-bf16-prepared",
        "(c) psrec in-process, bf16 dense, prepared Parquet (psrec data convert --prepared)",
        "ceiling-bf16",
        options=PsrecOptions(dense_precision="bf16", prepared=True),
        fp32_twin="psrec-prepared",
    ),
    _in_process(
        "psrec-bf16-compile-prepared",
        "(c) psrec in-process, bf16 dense, torch.compile, prepared Parquet",
        "ceiling-bf16-compile",
        options=PsrecOptions(dense_precision="bf16", compile_model=True, prepared=True),
    ),
    _in_process(
        "psrec-prepared", "(c) psrec in-process fp32, prepared Parquet", options=PsrecOptions(prepared=True)
    ),
    _in_process(
        "psrec-bf16-prepared-lazy",
        "(c) psrec-bf16-prepared with populate: false (reserved rows backed as they are first written)",
        "ceiling-bf16",
        options=PsrecOptions(dense_precision="bf16", prepared=True, populate=False),
    ),
    # Optional, in a Python of its own (PSREC_BENCH_TF_PYTHON / --tf-python); skipped without one.
    System(
        "tensorflow",
        "TensorFlow/Keras DLRM (Adagrad + Adam), its own Python process",
        tf_system.run_tensorflow,
    ),
    System(
        "tensorflow-bf16",
        "TensorFlow/Keras DLRM, Keras mixed_bfloat16 policy (fp32 tables)",
        partial(tf_system.run_tensorflow, bf16=True),
        ceiling="ceiling-bf16",
        precision="bf16",
        fp32_twin="tensorflow",
    ),
    System("ceiling", "(e) dense-only ceiling fp32", torch_systems.run_ceiling),
    System(
        "ceiling-bf16",
        "(e) dense-only ceiling bf16",
        partial(torch_systems.run_ceiling, bf16=True),
        ceiling="ceiling-bf16",
        precision="bf16",
        fp32_twin="ceiling",
    ),
    System(
        "ceiling-compile",
        "(e) dense-only ceiling fp32, torch.compile",
        partial(torch_systems.run_ceiling, compile_model=True),
        ceiling="ceiling-compile",
    ),
    System(
        "ceiling-bf16-compile",
        "(e) dense-only ceiling bf16, torch.compile",
        partial(torch_systems.run_ceiling, bf16=True, compile_model=True),
        ceiling="ceiling-bf16-compile",
        precision="bf16",
    ),
    # Extra layouts and settings (scaling model, thread experiments); not in the default set.
    System(
        "psrec-ray-1x1",
        "psrec Ray 1 trainer + 1 shard",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray", num_shards=1)),
    ),
    System(
        "psrec-ray-2x2",
        "psrec Ray 2 trainers + 2 shards",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray", num_trainers=2, trainer_threads=1)),
    ),
    System(
        "psrec-ray-2x2-nodes",
        "psrec Ray 2 trainers + 2 shards on 2 Ray nodes (one of each per node)",
        partial(
            psrec_systems.run_psrec,
            layout=PsrecLayout("ray", num_trainers=2, trainer_threads=1, nodes=2),
        ),
    ),
    System(
        "psrec-ray-t1",
        "psrec Ray 1x2, trainer 1 thread",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray", trainer_threads=1)),
    ),
    System(
        "psrec-ray-object-store",
        "psrec Ray 1x2, arrays through Ray's object store (ps.shared_memory false)",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray", shared_memory=False)),
    ),
    System(
        "psrec-ray-passive",
        "psrec Ray 1x2, OMP_WAIT_POLICY=PASSIVE",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("ray", omp_passive=True)),
    ),
    System(
        "pytorch-passive",
        "(a) plain PyTorch, OMP_WAIT_POLICY=PASSIVE",
        torch_systems.run_pytorch,
        env=tuple(PASSIVE.items()),
    ),
    System(
        "psrec-passive",
        "psrec in-process, OMP_WAIT_POLICY=PASSIVE",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("local", num_shards=1)),
        env=tuple(PASSIVE.items()),
    ),
    System(
        "psrec-ray-fp16",
        "psrec Ray 1x2, fp16 wire (ps.wire_precision)",
        partial(
            psrec_systems.run_psrec, layout=PsrecLayout("ray"), options=PsrecOptions(wire_precision="fp16")
        ),
        precision="fp32, fp16 wire",
        fp32_twin="psrec-ray",
    ),
    _in_process(
        "psrec-fp16rows",
        "psrec in-process, fp16 table rows (precision: fp16)",
        options=PsrecOptions(row_precision="fp16"),
        fp32_twin="psrec",
    ),
    _in_process(
        "psrec-int8rows",
        "psrec in-process, int8 table rows (precision: int8)",
        options=PsrecOptions(row_precision="int8"),
        fp32_twin="psrec",
    ),
    System(
        "psrec-bf16-grow",
        "psrec in-process bf16, no expected_rows (tables grow as rows arrive)",
        partial(
            psrec_systems.run_psrec,
            layout=PsrecLayout("local", num_shards=1),
            options=PsrecOptions(dense_precision="bf16", reserve=False),
        ),
        ceiling="ceiling-bf16",
        precision="bf16",
    ),
    System(
        "psrec-t1",
        "psrec in-process, 1 thread",
        partial(psrec_systems.run_psrec, layout=PsrecLayout("local", num_shards=1, trainer_threads=1)),
    ),
]
SYSTEMS: dict[str, System] = {system.name: system for system in _SYSTEMS}
# "x pytorch", "x torchrec", "x TF" and "x psrec" divide by the system of that kind at the same
# precision, and show "-" where none ran: a bf16 system is never divided by an fp32 baseline.
REFERENCES: dict[str, dict[str, str]] = {
    "pytorch": {"fp32": "pytorch", "bf16": "pytorch-bf16"},
    "torchrec": {"fp32": "torchrec", "bf16": "torchrec-bf16", "fp32, fp16 rows": "torchrec-fp16rows"},
    "tensorflow": {"fp32": "tensorflow", "bf16": "tensorflow-bf16"},
    "psrec": {
        "fp32": "psrec",
        "bf16": "psrec-bf16",
        "fp32, fp16 rows": "psrec-fp16rows",
        "fp32, int8 rows": "psrec-int8rows",
    },
}
# The other systems psrec is measured against; "x best peer" divides by the fastest of them (at the
# same precision, within each round).
PEERS = ("pytorch", "torchrec", "tensorflow")
ALIASES: dict[str, list[str]] = {
    "a": ["pytorch", "pytorch-bf16"],
    "b": ["torchrec", "torchrec-bf16"],
    "c": ["psrec", "psrec-bf16"],
    "d": ["psrec-ray"],
    "e": ["ceiling", "ceiling-bf16"],
}
DEFAULT_SYSTEMS = [
    "pytorch",
    "pytorch-bf16",
    "torchrec",
    "torchrec-bf16",
    "psrec",
    "psrec-bf16",
    "psrec-ray",
    "ceiling",
    "ceiling-bf16",
]


def reference(name: str, kind: str) -> str | None:
    """The system of `kind` ("pytorch", "torchrec", "tensorflow", "psrec") at `name`'s precision, if any."""
    return REFERENCES[kind].get(SYSTEMS[name].precision)


def resolve_systems(spec: str | list[str]) -> list[str]:
    """'a,b,psrec-ray-2x2' -> system names in the given order (letters a-e expand as in the issue)."""
    names: list[str] = []
    parts = spec.split(",") if isinstance(spec, str) else spec
    for part in (p.strip() for p in parts):
        if not part:
            continue
        expanded = ALIASES.get(part, [part])
        for name in expanded:
            if name not in SYSTEMS:
                raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)} (or the letters a-e)")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no system to run")
    return names
