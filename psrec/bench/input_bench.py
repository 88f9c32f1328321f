"""Input-pipeline throughput: Criteo TSV parse, Parquet read, batches delivered to a consumer.

Writes a synthetic Criteo-shaped dataset (full Kaggle cardinalities) as raw TSV and as Parquet in a
temporary directory, then measures, each best of `--repeats` runs:

- TSV parse: rows/s of the csv/tsv format reader alone (pyarrow parse into typed columns);
- Parquet read: rows/s of the Parquet format reader alone (row groups decoded, columns selected);
- batches: rows/s and batches/s that `open_reader` delivers to a consumer doing nothing (hashing of
  26 features, dense transforms, batching included), from TSV and from Parquet, with and without a
  shuffle buffer;
- overlap: a consumer that spends `--step-ms` per batch (a stand-in for a training step), with
  prefetch 0 (parse, then train) and prefetch 2 (parse while training).

Run: `python -m psrec.bench.input_bench --rows 200000` (prints a Markdown table; results are recorded
in docs/benchmarks.md, "Input pipeline").
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from psrec.data.errors import BadRows
from psrec.data.reader import make_format_reader, open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.data.units import expand_paths


def best_of(repeats: int, run: Callable[[], int]) -> tuple[float, int]:
    """(best seconds, rows) over `repeats` runs of `run`, which returns the rows it handled."""
    best, rows = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        rows = run()
        best = min(best, time.perf_counter() - start)
    return best, rows


def format_only(source: DataSource, base_dir: Path) -> int:
    """Rows parsed by the format reader alone (no hashing, no batching)."""
    reader = make_format_reader(
        source, criteo_schema(), expand_paths(source.paths, base_dir), BadRows("raise")
    )
    return sum(table.num_rows for unit in reader.units() for table in reader.read(unit, None))


def delivered(
    source: DataSource,
    base_dir: Path,
    *,
    batch_size: int,
    step_seconds: float = 0.0,
    shuffle_buffer: int = 0,
    prefetch: int = 2,
) -> int:
    """Rows `open_reader` delivers to a consumer that spends `step_seconds` on each batch."""
    rows = 0
    with open_reader(
        source,
        criteo_schema(),
        batch_size=batch_size,
        base_dir=base_dir,
        shuffle_buffer=shuffle_buffer,
        prefetch=prefetch,
    ) as reader:
        for batch in reader:
            rows += batch.batch_size
            if step_seconds:
                time.sleep(step_seconds)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated training step per batch")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        base = Path(directory)
        write_synthetic_criteo(base / "tsv", rows=args.rows, files=args.files, format="tsv")
        write_synthetic_criteo(base / "parquet", rows=args.rows, files=args.files, format="parquet")
        tsv_bytes = sum(p.stat().st_size for p in (base / "tsv").iterdir())
        tsv = DataSource(format="criteo_tsv", paths=["tsv/*.tsv"])
        parquet = DataSource(format="parquet", paths=["parquet/*.parquet"])
        batch = args.batch_size
        step = args.step_ms / 1000
        cases: list[tuple[str, Callable[[], int]]] = [
            ("Criteo TSV parse (format reader)", lambda: format_only(tsv, base)),
            ("Parquet read (format reader)", lambda: format_only(parquet, base)),
            ("TSV -> batches", lambda: delivered(tsv, base, batch_size=batch)),
            ("Parquet -> batches", lambda: delivered(parquet, base, batch_size=batch)),
            ("Parquet -> batches, shuffle_buffer 65536", lambda: delivered(parquet, base, batch_size=batch, shuffle_buffer=65536)),
            (f"Parquet -> consumer {args.step_ms:g} ms/batch, prefetch 0", lambda: delivered(parquet, base, batch_size=batch, step_seconds=step, prefetch=0)),
            (f"Parquet -> consumer {args.step_ms:g} ms/batch, prefetch 2", lambda: delivered(parquet, base, batch_size=batch, step_seconds=step, prefetch=2)),
        ]  # fmt: skip
        print(
            f"{args.rows} rows in {args.files} files, TSV {tsv_bytes / 1e6:.0f} MB, batch {batch}, {platform.processor() or platform.machine()}"
        )
        print("| case | seconds | rows/s | batches/s |")
        print("|---|---|---|---|")
        for name, run in cases:
            seconds, rows = best_of(args.repeats, run)
            print(f"| {name} | {seconds:.2f} | {rows / seconds:,.0f} | {rows / batch / seconds:,.1f} |")


if __name__ == "__main__":
    main()
