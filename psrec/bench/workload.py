"""The workload every `psrec bench` system runs: DLRM on synthetic Criteo-shaped data, batch 4096.

`Workload` holds the knobs (embedding dim, batch, rows, steps, threads, learning rates); the helpers
here are what the systems share, so that they train the same model on the same rows in the same order:

- `prepare_sources`: generate (once, cached in ~/.cache/psrec) the synthetic train/validation Parquet
  that `psrec train` would use, through the same `prepare_data` as the trainer;
- `load_batches`: the first batches of a split, in file order, read through psrec's reader and turned
  into plain tensors before any timing starts (the PyTorch-only systems get their input for free,
  which favours them: psrec reads its batches inside the timed loop);
- `build_dlrm`: the dense model, psrec's `DLRM` (bottom 13-512-256-D, dot interaction, top 512-256-1);
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
import torch

from psrec.data.synth import CRITEO_CARDINALITIES
from psrec.models.dlrm import DLRM

NUM_DENSE = 13
NUM_SPARSE = 26
BOTTOM_HIDDEN_SIZES = (512, 256)  # + the last bottom layer, of size dim
TOP_HIDDEN_SIZES = (512, 256)  # + the output layer, of size 1


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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def table_sizes(self) -> list[int]:
        """Rows per table of the fixed-size systems: the scaled cardinality, as the generator uses."""
        return [max(2, round(c * self.cardinality_scale)) for c in CRITEO_CARDINALITIES]

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
    from psrec.train.data_sources import prepare_data

    if workload.cache_dir is not None:
        os.environ["PSREC_CACHE"] = workload.cache_dir
    config = parse_config(
        {"data": {"synthetic": synthetic_config(workload)}, "model": {"name": "dlrm"}},
        source="<bench>",
    )
    return prepare_data(config, base_dir=Path("."))


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


def load_batches(
    source: dict[str, Any], *, batch_size: int, max_batches: int | None = None
) -> list[TensorBatch]:
    """The first `max_batches` batches of `source` in file order (as psrec's trainer sees them)."""
    from psrec.data.reader import open_reader
    from psrec.data.schema import DataSource
    from psrec.data.synth import criteo_schema

    out: list[TensorBatch] = []
    reader = open_reader(DataSource.model_validate(source), criteo_schema(), batch_size=batch_size)
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
        NUM_SPARSE,
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
