"""The workload every `psrec bench` system runs: DLRM on synthetic Criteo-shaped data, batch 4096.

`Workload` holds the knobs (embedding dim, batch, rows, steps, threads, learning rates, multi-hot
features); the helpers here are what the systems share, so that they train the same model on the
same rows in the same order:

- `prepare_sources`: generate (once, cached in ~/.cache/psrec) the synthetic train/validation Parquet
  that `psrec train` would use, through the same `prepare_data` as the trainer; with multi-hot
  features, a copy of it with those columns added (`write_multi_hot`);
- `load_batches`: the first batches of a split, in file order, read through psrec's reader and turned
  into plain tensors before any timing starts (the PyTorch-only systems get their input for free,
  which favours them: psrec reads its batches inside the timed loop);
- `build_dlrm`: the dense model, psrec's `DLRM` (bottom 13-512-256-D, dot interaction, top 512-256-1);
- `bench_schema`: the features every system reads: Criteo's C1..C26 (one id each), then the
  multi-hot M1..Mk.

**Multi-hot features** (`Workload.multi_hot_features` = k, `pooling_factor` = p, `bag_lengths`):
k more sparse features M1..Mk, each a bag of ids per sample, as user histories and tags are:
exactly p ids per bag ("fixed") or a uniform number in [0, 2p] ("variable": mean p, empty bags
included). Ids are integers already (a catalogue's item numbers: `hashed: false`), Zipf-distributed
like the Criteo ids over `MULTI_HOT_CARDINALITY` x `cardinality_scale` ids per feature, and half of
them carry a noisy copy of the row's label (the label in 65% of the rows, one copy per row for all
features) in their lowest bit, so that the bags are worth learning without giving the label away. Every system
pools a bag by summing its rows.
- `Workload.device`: where the dense model trains ("cpu", or "cuda" on a GPU machine: `psrec bench
  --device`); the PyTorch systems move their tables, model and batches there, psrec sets
  ``training.device``; TorchRec and TensorFlow run on the CPU.
- `peak_rss_bytes`, `process_cpu_seconds`, `set_threads`: measurement plumbing. Besides wall-clock
  samples/s every system reports samples per CPU-second (all its threads and processes, spinning
  OpenMP threads included), which other jobs on the machine disturb far less.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from psrec.data.schema import CRITEO_LABEL, Schema, SparseFeature
from psrec.data.synth import CRITEO_CARDINALITIES
from psrec.models.dlrm import DLRM

NUM_DENSE = 13
NUM_SPARSE = 26
BOTTOM_HIDDEN_SIZES = (512, 256)  # + the last bottom layer, of size dim
TOP_HIDDEN_SIZES = (512, 256)  # + the output layer, of size 1
MULTI_HOT_CARDINALITY = 2_000_000  # ids per multi-hot feature at cardinality_scale 1
BAG_LENGTHS = ("fixed", "variable")
LABEL_AGREEMENT = 0.65  # rows whose bags carry their own label (the others carry its opposite)
ZIPF_EXPONENT = 1.15  # of the multi-hot ids, as of the Criteo-shaped generator's


@dataclass(frozen=True)
class Workload:
    """What every system runs; defaults are the issue's workload at a memory-friendly scale."""

    dim: int = 64
    batch_size: int = 4096
    train_rows: int = 200_000
    validation_rows: int = 50_000
    # Criteo Kaggle's cardinalities times this (1.0 = 33.8M rows in all: 8.6 GB of fp32 rows at dim 64).
    cardinality_scale: float = 0.05
    warmup_steps: int = 2
    steps: int = 10  # timed steps after the warm-up
    threads: int = 2
    sparse_lr: float = 0.05
    dense_lr: float = 1e-3
    init_scale: float = 0.05  # embedding rows start uniform in [-init_scale, init_scale]
    seed: int = 0
    cache_dir: str | None = None  # where the synthetic data goes (default: psrec's cache)
    # Multi-hot features M1..Mk after C1..C26 (see the module docstring): k, ids per bag, lengths.
    multi_hot_features: int = 0
    pooling_factor: int = 1
    bag_lengths: str = "fixed"
    device: str = "cpu"  # "cpu" or "cuda" (see the module docstring)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def num_sparse(self) -> int:
        return NUM_SPARSE + self.multi_hot_features

    @property
    def multi_hot_names(self) -> list[str]:
        return [f"M{j + 1}" for j in range(self.multi_hot_features)]

    def multi_hot_cardinality(self) -> int:
        return max(2, round(MULTI_HOT_CARDINALITY * self.cardinality_scale))

    def table_sizes(self) -> list[int]:
        """Rows per table of the fixed-size systems: the scaled cardinality, as the generator uses."""
        criteo = [max(2, round(c * self.cardinality_scale)) for c in CRITEO_CARDINALITIES]
        return criteo + [self.multi_hot_cardinality()] * self.multi_hot_features

    def describe(self) -> str:
        """ "26 one-hot" or "26 one-hot + 8 multi-hot x 50 (variable)"."""
        text = f"{NUM_SPARSE} one-hot"
        if self.multi_hot_features:
            text += f" + {self.multi_hot_features} multi-hot x {self.pooling_factor} ({self.bag_lengths})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        needed = self.total_steps * self.batch_size
        if needed > self.train_rows:
            raise ValueError(
                f"{self.total_steps} steps of {self.batch_size} rows need {needed} training rows, "
                f"only {self.train_rows} are generated: raise --rows or lower --steps"
            )
        if self.dim < 1 or self.steps < 1 or self.warmup_steps < 0 or self.threads < 1:
            raise ValueError(f"bad workload {self}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"workload device must be cpu or cuda, not {self.device!r}")
        if self.multi_hot_features < 0 or self.pooling_factor < 1 or self.bag_lengths not in BAG_LENGTHS:
            raise ValueError(
                f"multi-hot: need features >= 0, pooling factor >= 1 and bag lengths in {BAG_LENGTHS}, got "
                f"{self.multi_hot_features}:{self.pooling_factor}:{self.bag_lengths}"
            )


def parse_multi_hot(spec: str) -> tuple[int, int, str]:
    """ "FEATURES:POOLING[:fixed|variable]" (`psrec bench --multi-hot`) -> (features, pooling, lengths)."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        features, pooling = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(
            f"--multi-hot {spec!r}: expected FEATURES:POOLING[:fixed|variable], e.g. 8:50:variable"
        ) from None
    lengths = parts[2] if len(parts) == 3 else "fixed"
    if features < 1 or pooling < 1 or lengths not in BAG_LENGTHS:
        raise ValueError(
            f"--multi-hot {spec!r}: FEATURES and POOLING must be >= 1 and the lengths one of {BAG_LENGTHS}"
        )
    return features, pooling, lengths


def bench_schema(workload: Workload) -> Schema:
    """The features every system reads: Criteo's label, I1..I13, C1..C26, then M1..Mk (multi-hot)."""
    from psrec.data.synth import criteo_schema

    schema = criteo_schema()
    if not workload.multi_hot_features:
        return schema
    extra = [
        SparseFeature(name=name, table=name, multi_valued=True, hashed=False)
        for name in workload.multi_hot_names
    ]
    return schema.model_copy(update={"sparse": [*schema.sparse, *extra]})


def synthetic_config(workload: Workload) -> dict[str, Any]:
    """The `data.synthetic` section of a psrec config for this workload."""
    return {
        "train_rows": workload.train_rows,
        "validation_rows": workload.validation_rows,
        "cardinality_scale": workload.cardinality_scale,
        "seed": workload.seed,
    }


def prepare_sources(workload: Workload) -> dict[str, dict[str, Any]]:
    """Generate the data once (cached) and return the sources by split, as `psrec train` sees them."""
    from psrec.config import parse_config
    from psrec.train.data_sources import prepare_data, synthetic_cache_dir

    if workload.cache_dir is not None:
        os.environ["PSREC_CACHE"] = workload.cache_dir
    config = parse_config(
        {"data": {"synthetic": synthetic_config(workload)}, "model": {"name": "dlrm"}},
        source="<bench>",
    )
    sources = prepare_data(config, base_dir=Path("."))
    if not workload.multi_hot_features:
        return sources
    out = {}
    for index, (split, source) in enumerate(sorted(sources.items())):
        base = Path(source["paths"][0]).parent
        target = (
            synthetic_cache_dir()
            / "bench"
            / (
                f"{base.name}-multihot{workload.multi_hot_features}x{workload.pooling_factor}-{workload.bag_lengths}"
            )
        )
        if not (target / "_SUCCESS").exists():
            write_multi_hot(
                sorted(base.glob("*.parquet")), target, workload, seed=workload.seed + 101 * (index + 1)
            )
            (target / "_SUCCESS").write_text("ok\n")
        out[split] = {"format": "parquet", "paths": [str(target / "*.parquet")]}
    return out


def multi_hot_column(
    labels: np.ndarray, rng: np.random.Generator, *, pooling: int, lengths: str, cardinality: int
) -> pa.Array:
    """One multi-hot column (list<int64>) whose ids carry `labels` (the rows' noisy labels: see the
    module docstring) in their lowest bit."""
    rows = labels.shape[0]
    counts = (
        np.full(rows, pooling, np.int64)
        if lengths == "fixed"
        else rng.integers(0, 2 * pooling + 1, size=rows)
    )
    total = int(counts.sum())
    ids = (rng.zipf(ZIPF_EXPONENT, total) - 1) % cardinality
    carries = rng.random(total) < 0.5  # these ids carry their row's label in the lowest bit
    row_labels = np.repeat(labels.astype(np.int64), counts)
    ids = np.where(carries, np.minimum((ids & ~1) | row_labels, cardinality - 1), ids)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int64)))


def write_multi_hot(files: list[Path], target: Path, workload: Workload, *, seed: int) -> None:
    """Copies of `files` (synthetic Criteo Parquet) with the workload's multi-hot columns added."""
    target.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for path in files:
        table = pq.read_table(path)
        labels = table.column(CRITEO_LABEL).to_numpy().astype(np.int64)
        noisy = np.where(rng.random(labels.shape[0]) < LABEL_AGREEMENT, labels, 1 - labels)
        for name in workload.multi_hot_names:
            column = multi_hot_column(
                noisy,
                rng,
                pooling=workload.pooling_factor,
                lengths=workload.bag_lengths,
                cardinality=workload.multi_hot_cardinality(),
            )
            table = table.append_column(name, column)
        pq.write_table(table, target / path.name, row_group_size=65536, compression="zstd")


@dataclass
class TensorBatch:
    """One batch as tensors: dense (B, 13), labels (B,), ids/offsets per sparse feature (schema order)."""

    dense: torch.Tensor
    labels: torch.Tensor
    ids: list[torch.Tensor]  # per feature: (n_f,) int64 hashed ids
    offsets: list[torch.Tensor]  # per feature: (B,) int64 bag starts
    lengths: list[torch.Tensor]  # per feature: (B,) int64

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> TensorBatch:
        """The same batch on `device` (itself on the CPU)."""
        if device.type == "cpu":
            return self
        return TensorBatch(
            self.dense.to(device),
            self.labels.to(device),
            [t.to(device) for t in self.ids],
            [t.to(device) for t in self.offsets],
            [t.to(device) for t in self.lengths],
        )


def load_batches(
    source: dict[str, Any], workload: Workload, *, batch_size: int, max_batches: int | None = None
) -> list[TensorBatch]:
    """The first `max_batches` batches of `source` in file order (as psrec's trainer sees them)."""
    from psrec.data.reader import open_reader
    from psrec.data.schema import DataSource

    out: list[TensorBatch] = []
    reader = open_reader(DataSource.model_validate(source), bench_schema(workload), batch_size=batch_size)
    try:
        for batch in reader:
            ids, offsets, lengths = [], [], []
            for key in batch.sparse.keys:
                feature_ids, feature_lengths = batch.sparse.feature(key)
                starts = np.zeros(feature_lengths.size, dtype=np.int64)
                np.cumsum(feature_lengths[:-1], out=starts[1:])
                ids.append(torch.from_numpy(feature_ids.copy()))
                offsets.append(torch.from_numpy(starts))
                lengths.append(torch.from_numpy(feature_lengths.astype(np.int64)))
            out.append(
                TensorBatch(
                    torch.from_numpy(np.array(batch.dense, dtype=np.float32)),
                    torch.from_numpy(np.array(batch.labels, dtype=np.float32)),
                    ids,
                    offsets,
                    lengths,
                )
            )
            if max_batches is not None and len(out) >= max_batches:
                break
    finally:
        reader.close()
    return out


def build_dlrm(workload: Workload) -> DLRM:

    return DLRM(
        NUM_DENSE,
        workload.num_sparse,
        workload.dim,
        bottom_hidden_sizes=BOTTOM_HIDDEN_SIZES,
        top_hidden_sizes=TOP_HIDDEN_SIZES,
    )


def set_threads(threads: int) -> None:
    """Pin torch/numba/OpenMP threads as psrec's trainers do: the systems share 2 cores with other jobs."""
    from psrec.threads import set_thread_counts

    set_thread_counts(threads)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process so far, 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_peak_rss(pid: int) -> int:
    """VmHWM (peak RSS) of another process, 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
