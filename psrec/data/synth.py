"""A synthetic Criteo-shaped dataset with a learnable label, for tests, the quickstart and benchmarks.

Rows have Criteo Kaggle's layout: a 0/1 label, 13 non-negative integer counts I1..I13 (some missing)
and 26 categorical features C1..C26 written as 8-digit hex text (some missing), whose ids follow a
Zipf law over Criteo-Kaggle-like cardinalities (`cardinality_scale` shrinks them for tests).

The label comes from a fixed hidden model, the same for every seed::

    logit = bias + sum_f w_f[id_f] + sum_j v_j * standardised(log1p(I_j)) + sum_{f<g in P} <u_f[id_f], u_g[id_g]>
    label ~ Bernoulli(sigmoid(logit))

with per-id weights w and 4-dim factors u drawn from a hash of (feature, id rank), so every id has its
weight without storing a table; P is a handful of feature pairs (something for FM/DCN to find). The
Bayes-optimal AUC is ~0.80 and a good model trained on a few million rows gets ~0.75-0.78; the
positive rate is ~25%, like Criteo's.

Run: `psrec data synth OUT_DIR --rows 1000000 --files 4 --format parquet`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from psrec.data.schema import CRITEO_DENSE, CRITEO_LABEL, CRITEO_SPARSE, DenseFeature, Schema, SparseFeature

logger = logging.getLogger(__name__)

# Criteo Kaggle (display advertising challenge) per-feature cardinalities, C1..C26.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Fraction of missing values per feature (roughly Criteo's).
_SPARSE_MISSING = (
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.0, 0.0, 0.03, 0.44, 0.44,
)  # fmt: skip
_DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22)
_DENSE_LOG_MEAN = (0.5, 1.5, 2.0, 1.5, 7.5, 3.5, 1.5, 2.5, 3.5, 0.3, 1.0, 0.3, 1.5)
_ZIPF_EXPONENT = 1.15
_INTERACTION_PAIRS = ((0, 1), (1, 5), (2, 3), (6, 12), (13, 16))
_FACTOR_DIM = 4
_BIAS = -1.9
_WEIGHT_SCALE = 0.22
_FACTOR_SCALE = 0.5
_DENSE_WEIGHTS = (0.25, -0.1, 0.0, -0.15, 0.2, 0.0, 0.1, 0.0, -0.2, 0.15, 0.0, 0.05, -0.1)


def criteo_schema(*, table_per_feature: bool = True, shared_table: str = "criteo") -> Schema:
    """The `Schema` of (synthetic or real) Criteo data: label, I1..I13 (log1p), C1..C26 (hashed).

    Each sparse feature gets its own table named after it, or all share `shared_table` (their
    namespaces keep their ids apart).
    """
    return Schema(
        label=CRITEO_LABEL,
        dense=[DenseFeature(name=name, log1p=True) for name in CRITEO_DENSE],
        sparse=[
            SparseFeature(name=name, table=name if table_per_feature else shared_table)
            for name in CRITEO_SPARSE
        ],
    )


def splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic): a well-mixed hash of each value."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _uniform(feature: int, salt: int, ranks: np.ndarray) -> np.ndarray:
    """Deterministic uniform(-1, 1) per (feature, salt, rank), the hidden model's parameters."""
    key = ranks.astype(np.uint64) ^ np.uint64(((feature + 1) * 0x1000193 + salt * 0x9E37) << 32)
    bits = splitmix64(key) >> np.uint64(11)
    return bits.astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def _hex_text(values: np.ndarray, missing: np.ndarray) -> pa.Array:
    """uint32 values -> 8-digit lowercase hex strings (null where `missing`), vectorised: the
    strings are built in Arrow from the digits' bytes, never as Python objects."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    nibbles = (values[:, None].astype(np.uint32) >> shifts) & np.uint32(15)
    chars = digits[nibbles].astype(np.uint8)
    return pa.array(chars.view("S8").ravel(), pa.binary(8), mask=missing).cast(pa.string())


def _generate(rows: int, rng: np.random.Generator, cardinality_scale: float) -> tuple[pa.Table, np.ndarray]:
    """(table, hidden logits) of `rows` fresh rows."""
    logit = np.full(rows, _BIAS)
    columns: dict[str, pa.Array] = {}
    dense_arrays = []
    for j in range(len(CRITEO_DENSE)):
        counts = np.floor(np.expm1(rng.normal(_DENSE_LOG_MEAN[j], 1.0, rows).clip(0, None)))
        missing = rng.random(rows) < _DENSE_MISSING[j]
        standardised = (np.log1p(counts) - _DENSE_LOG_MEAN[j]) / 1.0
        logit += np.where(missing, 0.0, _DENSE_WEIGHTS[j] * standardised)
        dense_arrays.append(pa.array(counts.astype(np.int64), mask=missing))
    factors: dict[int, np.ndarray] = {}
    sparse_arrays = []
    for f, cardinality in enumerate(CRITEO_CARDINALITIES):
        size = max(2, round(cardinality * cardinality_scale))
        ranks = (rng.zipf(_ZIPF_EXPONENT, rows) - 1) % size
        missing = rng.random(rows) < _SPARSE_MISSING[f]
        weight = _WEIGHT_SCALE * _uniform(f, 0, ranks) * (1.0 + 1.5 * (ranks < 50))
        logit += np.where(missing, 0.0, weight)
        if any(f in pair for pair in _INTERACTION_PAIRS):
            stacked = np.stack([_uniform(f, 1 + k, ranks) for k in range(_FACTOR_DIM)], axis=1)
            factors[f] = np.where(missing[:, None], 0.0, stacked * _FACTOR_SCALE)
        # A bijection of the rank on 32 bits (odd multiplier, then xor) gives distinct hex values.
        with np.errstate(over="ignore"):
            encoded = (ranks.astype(np.uint32) * np.uint32(2654435761 | 1)) ^ np.uint32(
                (0x5BD1E995 * (f + 7)) & 0xFFFFFFFF
            )
        sparse_arrays.append(_hex_text(encoded, missing))
    for f, g in _INTERACTION_PAIRS:
        logit += (factors[f] * factors[g]).sum(axis=1)
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int32)
    columns[CRITEO_LABEL] = pa.array(labels)
    columns.update(zip(CRITEO_DENSE, dense_arrays, strict=True))
    columns.update(zip(CRITEO_SPARSE, sparse_arrays, strict=True))
    return pa.table(columns), logit


def write_synthetic_criteo(
    path: str | Path,
    *,
    rows: int,
    files: int = 1,
    seed: int = 0,
    format: str = "parquet",
    cardinality_scale: float = 1.0,
    row_group_rows: int = 65536,
    chunk_rows: int = 262144,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write `rows` synthetic rows split over `files` files in directory `path`; return their paths.

    `format` is "parquet" (one row group per `row_group_rows` rows) or "tsv" (Criteo's raw layout: tab
    separated, no header, empty = missing; "tsv.gz" gzips it). Rows are generated in chunks of
    `chunk_rows` so memory stays bounded; `progress(rows_done)` is called after each chunk.
    """
    if format not in ("parquet", "tsv", "tsv.gz"):
        raise ValueError(f"format must be 'parquet', 'tsv' or 'tsv.gz', not {format!r}")
    if rows < 0 or files < 1:
        raise ValueError(f"need rows >= 0 and files >= 1, got rows={rows}, files={files}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written: list[Path] = []
    done = 0
    for index in range(files):
        file_rows = rows // files + (index < rows % files)
        target = directory / f"part-{index:05d}.{format}"
        written.append(target)
        writer: pq.ParquetWriter | pa_csv.CSVWriter | None = None
        sink: pa.NativeFile | None = None
        try:
            if format == "parquet":
                schema = _generate(1, np.random.default_rng(0), cardinality_scale)[0].schema
                writer = pq.ParquetWriter(target, schema, compression="zstd")
            else:
                sink = pa.CompressedOutputStream(str(target), "gzip") if format == "tsv.gz" else None
                schema = _generate(1, np.random.default_rng(0), cardinality_scale)[0].schema
                options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
                writer = pa_csv.CSVWriter(
                    sink if sink is not None else str(target), schema, write_options=options
                )
            remaining = file_rows
            while remaining > 0:
                count = min(chunk_rows, remaining)
                table, _ = _generate(count, rng, cardinality_scale)
                if isinstance(writer, pq.ParquetWriter):
                    writer.write_table(table, row_group_size=row_group_rows)
                else:
                    writer.write_table(table)
                remaining -= count
                done += count
                if progress is not None:
                    progress(done)
        finally:
            if writer is not None:
                writer.close()
            if sink is not None:
                sink.close()
        logger.info("wrote %d synthetic rows to %s", file_rows, target)
    return written
