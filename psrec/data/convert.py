"""Convert raw Criteo TSV / CSV / libfm files into Parquet with the schema's columns.

Each input file becomes one Parquet file of the same stem in the output directory, with row groups of
`row_group_rows` rows (the unit of sharding and resume when reading it back). Columns keep the types
the text readers parse them to (labels and dense features float64, hashed features text, pass-through
ids int64, libfm multi-valued fields lists), so reading the Parquet files with the same schema gives
exactly the batches the raw files give. Bad rows raise or are skipped as `source.on_error` says.

With `prepared=True` the files hold what training makes of the rows instead (`prepare_table`: ids
hashed to int64, dense values transformed to float32, labels float32), marked with the schema they
were prepared for. Reading them skips decoding text and hashing: on the bench's Criteo-shaped data
that is most of the input pipeline's work (one raw row group of 65,536 rows costs 28-34 ms to decode
and 17-26 ms to prepare on one thread; a prepared one decodes in 7.2 ms). Parquet input is accepted
then too. Prepared files are tied to the schema: another schema refuses to read them.

Run: `psrec data convert day_0.tsv.gz day_1.tsv.gz --format criteo_tsv --out data/criteo`
(add `--prepared` for prepared files).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from psrec.data.errors import BadRows
from psrec.data.features import ROW_ID, mark_prepared, prepare_table, schema_fingerprint
from psrec.data.reader import make_format_reader
from psrec.data.schema import DataSource, Schema
from psrec.data.units import Unit, expand_paths, local_files

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"  # files being written; renamed onto their names when the whole output is complete


def _unit_size(unit: Unit) -> int:
    if unit.stop >= 0:
        return unit.stop - unit.start
    return Path(unit.path).stat().st_size


def convert_to_parquet(
    source: DataSource,
    schema: Schema,
    output_dir: str | Path,
    *,
    base_dir: str | Path = ".",
    row_group_rows: int = 65536,
    progress: Callable[[int, int], None] | None = None,
    prepared: bool = False,
) -> tuple[list[Path], dict[str, Any]]:
    """Write one Parquet file per input file; return the paths and a summary: rows, and the counts of
    `BatchReader.stats()` (rows_skipped, skipped_samples, units_failed, bytes_lost, failed_units, and
    the dense values filled or clipped, counted here when `prepared`, else when the output is read).

    `progress(done, total)` is called after each unit with the input bytes (or rows) done and in all.
    """
    if source.format == "interactions" or (source.format == "parquet" and not prepared):
        raise ValueError(
            f"convert reads csv, criteo_tsv or libfm files (and Parquet with prepared=True), not {source.format!r}"
        )
    errors = BadRows(source.on_error)
    files = local_files(expand_paths(source.paths, base_dir))
    output = Path(output_dir)
    refuse_overlap(files, output)
    reader = make_format_reader(source, schema, files, errors)
    units = reader.units()
    total = sum(_unit_size(unit) for unit in units)
    output.mkdir(parents=True, exist_ok=True)
    # Prepared files are read every epoch: LZ4 decodes a row group of the bench's 40 columns in 7.2
    # ms against zstd's 11.2 (one thread), for 16% more bytes.
    compression = "lz4" if prepared else "zstd"
    fingerprint = schema_fingerprint(schema)
    written: list[Path] = []
    staged: list[Path] = []  # temporary files, renamed onto `written` once every file is complete
    rows = 0
    done = [0]

    def unit_done(unit: Unit) -> None:
        done[0] += _unit_size(unit)
        if progress is not None:
            progress(done[0], total)

    try:
        for index, path in enumerate(files):
            name = path.name.removesuffix(".gz")
            target = output / (Path(name).stem + ".parquet")
            if target in written:
                target = output / f"{Path(name).stem}-{index}.parquet"
            temporary = output / f"{TEMP_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}"
            staged.append(temporary)
            tables = _tables_of_file(reader, [u for u in units if u.file_index == index], unit_done)
            if prepared:
                tables = (
                    mark_prepared(prepare_table(schema, table, errors), fingerprint) for table in tables
                )
            tables = (table.drop_columns([ROW_ID]) for table in tables)
            file_rows = _write_parquet(
                temporary, tables, row_group_rows=row_group_rows, compression=compression
            )
            if file_rows is None:
                logger.warning("%s has no rows; no Parquet file written", path)
                staged.pop()
                continue
            rows += file_rows
            written.append(target)
            logger.info("converted %s -> %s", path, target)
        for temporary, target in zip(staged, written, strict=True):  # every file is complete: publish
            os.replace(temporary, target)
    except BaseException:
        for temporary in staged:
            temporary.unlink(missing_ok=True)
        raise
    summary = {"rows": rows, **errors.snapshot().as_dict()}
    return written, summary


def refuse_overlap(inputs: list[Path], output: Path) -> None:
    """Refuse an output directory that is, or holds, one of the inputs: writing it would destroy them."""
    resolved = output.resolve()
    for path in inputs:
        source = path.resolve()
        if source == resolved or resolved in source.parents:
            raise ValueError(
                f"--out {output} holds the input file {path}: converting into it could overwrite the input. "
                "Write the output to a directory that holds none of the inputs."
            )


def _tables_of_file(reader: Any, units: list[Unit], unit_done: Callable[[Unit], None]) -> Iterator[pa.Table]:
    """One input file's rows as tables, unit by unit."""
    for unit in units:
        yield from reader.read(unit, None)
        unit_done(unit)


def _write_parquet(
    path: Path, tables: Iterable[pa.Table], *, row_group_rows: int, compression: str
) -> int | None:
    """Write `tables` to `path` in row groups of `row_group_rows`; returns the rows written, None when
    there was no table at all (then no file is written)."""
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []
    pending_rows = rows = 0
    try:
        for table in tables:
            pending.append(table)
            pending_rows += table.num_rows
            while pending_rows >= row_group_rows:
                merged = pa.concat_tables(pending).combine_chunks()
                writer = writer or pq.ParquetWriter(path, merged.schema, compression=compression)
                writer.write_table(merged.slice(0, row_group_rows), row_group_size=row_group_rows)
                rest = merged.slice(row_group_rows)
                pending, pending_rows = [rest], rest.num_rows
                rows += row_group_rows
        if pending_rows or (writer is None and pending):
            merged = pa.concat_tables(pending)
            writer = writer or pq.ParquetWriter(path, merged.schema, compression=compression)
            writer.write_table(merged, row_group_size=row_group_rows)
            rows += merged.num_rows
    finally:
        if writer is not None:
            writer.close()
    return None if writer is None else rows
