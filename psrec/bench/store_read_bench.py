"""Reading training data from an object store against local disk, with and without prefetch.

Writes a synthetic Criteo-shaped Parquet set, copies it to an S3-compatible store (moto's server,
started here in its own process on 127.0.0.1), and measures the rows/s `open_reader` delivers (row
groups read with ranged GETs, hashing, dense transforms and batching included), medians of
`--rounds` interleaved rounds:

- a consumer doing nothing: the read path's own throughput;
- a consumer spending `--step-ms` per batch (a stand-in for a training step), prefetch 0 (read,
  then train) against prefetch 2 (read while training): how much of the store's latency prefetch
  hides.

Run: `python -m psrec.bench.store_read_bench --rows 200000` (prints a Markdown table; the figures are
in docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from psrec.bench.cluster_bench import make_bucket, start_store
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.storage import StoragePath


def rows_per_second(source: DataSource, *, batch_size: int, prefetch: int, step_s: float) -> float:
    reader = open_reader(source, criteo_schema(), batch_size=batch_size, prefetch=prefetch)
    rows = 0
    start = time.perf_counter()
    try:
        for batch in reader:
            rows += batch.batch_size
            if step_s:
                time.sleep(step_s)
    finally:
        reader.close()
    return rows / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="psrec-store-read-") as tmp:
        root = Path(tmp)
        files = write_synthetic_criteo(root / "train", rows=args.rows, files=4, cardinality_scale=0.01)
        store, environment = start_store(root / "moto.log")
        try:
            os.environ.update(environment)
            bucket = make_bucket(environment)
            for path in files:
                StoragePath(f"s3://{bucket}/train/{path.name}").write_bytes(path.read_bytes())
            where = {
                "local disk": DataSource(format="parquet", paths=[str(root / "train" / "*.parquet")]),
                "S3 (moto, 127.0.0.1)": DataSource(
                    format="parquet", paths=[f"s3://{bucket}/train/*.parquet"]
                ),
            }
            cases = [
                ("no consumer work, prefetch 2", 2, 0.0),
                (f"{args.step_ms:.0f} ms per batch, prefetch 0", 0, args.step_ms / 1000),
                (f"{args.step_ms:.0f} ms per batch, prefetch 2", 2, args.step_ms / 1000),
            ]
            measured: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for case, prefetch, step_s in cases:
                    for name, source in where.items():
                        value = rows_per_second(
                            source, batch_size=args.batch_size, prefetch=prefetch, step_s=step_s
                        )
                        measured.setdefault((case, name), []).append(value)
        finally:
            store.kill()
    names = list(where)
    print(
        f"| rows/s (median of {args.rounds}, {args.rows:,} rows, batch {args.batch_size}) | "
        + " | ".join(names)
        + " | store / local |"
    )
    print("|---|" + "---|" * (len(names) + 1))
    for case, _, _ in cases:
        values = [statistics.median(measured[(case, name)]) for name in names]
        print(f"| {case} | " + " | ".join(f"{v:,.0f}" for v in values) + f" | {values[1] / values[0]:.2f} |")


if __name__ == "__main__":
    main()
