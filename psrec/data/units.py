"""The units a dataset is cut into, and which shard reads which: pure functions over plain data.

A dataset is an ordered list of files (each path or glob of `DataSource.paths` in order; a glob's
matches sorted). Each file is cut into units, the grain of sharding and resume:

- Parquet: one unit per row group (rows [start, stop) of the file);
- uncompressed text: byte ranges of `split_bytes`; a line belongs to the range holding its first byte
  (Hadoop's rule), so ranges need no line index;
- gzip text: the whole file (a gzip stream cannot be entered in the middle).

Unit i of the dataset goes to shard i mod N: N shards get disjoint shares whose union is the
dataset, the same for every epoch and seed. Each row has a stable global id::

    row_id = file_index * 2**40 + offset   # offset: row number in a Parquet file, byte offset of
                                           # the line in a text file (uncompressed), user id for
                                           # interactions

A path may be a store URI (``s3://bucket/data/*.parquet``, `psrec.storage`; a glob only in its last
part): Parquet is read through the store's pyarrow file system; the text formats read local files.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from psrec.storage import Location, StoragePath, is_uri

OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Unit:
    """A piece of one file: rows [start, stop) (Parquet), bytes [start, stop) (text; stop -1 = to the end)."""

    file_index: int
    path: str
    start: int
    stop: int
    row_group: int = -1  # Parquet only


def row_id_base(file_index: int) -> int:
    return file_index << OFFSET_BITS


def expand_paths(patterns: list[str], base_dir: str | Path = ".") -> list[Location]:
    """Files named by `patterns` (paths, globs or store URIs; relative paths resolved against
    `base_dir`), in order. A store that cannot be reached raises `StorageError` naming the URI."""
    base = Path(base_dir)
    files: list[Location] = []
    for pattern in patterns:
        if is_uri(pattern):
            files.extend(_expand_uri(pattern))
            continue
        full = Path(pattern) if Path(pattern).is_absolute() else base / pattern
        if glob.has_magic(str(full)):
            matches = sorted(Path(p) for p in glob.glob(str(full)) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(f"no file matches {pattern!r} (looked in {full.parent})")
            files.extend(matches)
        else:
            if not full.is_file():
                raise FileNotFoundError(f"data file {pattern!r} not found (looked for {full})")
            files.append(full)
    if len(files) >= 1 << (63 - OFFSET_BITS):
        raise ValueError(f"too many files ({len(files)}) for 40-bit row offsets")
    return files


def _expand_uri(pattern: str) -> list[StoragePath]:
    path = StoragePath(pattern)
    if glob.has_magic(str(path.parent)):
        raise ValueError(f"{pattern}: a glob in a store URI may only be in its last part")
    if glob.has_magic(path.name):
        matches = path.parent.glob_files(path.name)
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        return matches
    if not path.is_file():
        raise FileNotFoundError(f"data file {pattern!r} not found")
    return [path]


def parquet_file(path: str | Location, **options: object) -> pq.ParquetFile:
    """A `pyarrow.parquet.ParquetFile` of a local path or a store URI."""
    if isinstance(path, StoragePath) or is_uri(str(path)):
        return pq.ParquetFile(StoragePath(str(path)).open_input_file(), **options)  # type: ignore[arg-type,unused-ignore]
    return pq.ParquetFile(path, **options)  # type: ignore[arg-type,unused-ignore]


def _local(path: str | Location) -> Path:
    if isinstance(path, StoragePath) or is_uri(str(path)):
        raise ValueError(
            f"{path}: the text formats read local files only; convert the data to Parquet "
            "(`psrec data convert`) to read it from a store"
        )
    return Path(path)


def local_files(files: Sequence[Location]) -> list[Path]:
    """``files`` as local paths; ValueError naming the first store URI among them."""
    return [_local(path) for path in files]


def is_gzip(path: str | Location) -> bool:
    with open(_local(path), "rb") as handle:
        return handle.read(2) == GZIP_MAGIC


def parquet_units(file_index: int, path: Location) -> list[Unit]:
    metadata = parquet_file(path).metadata
    units = []
    start = 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        units.append(Unit(file_index, str(path), start, start + rows, row_group=group))
        start += rows
    return units


def text_units(file_index: int, path: Location, split_bytes: int) -> list[Unit]:
    if is_gzip(path):
        return [Unit(file_index, str(path), 0, -1)]
    size = _local(path).stat().st_size
    return [
        Unit(file_index, str(path), start, min(start + split_bytes, size))
        for start in range(0, max(size, 1), split_bytes)
    ]


def shard_units(units: list[Unit], shard: int, num_shards: int) -> list[Unit]:
    """Units of shard `shard` of `num_shards`: every num_shards-th unit, starting at `shard`."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
    return units[shard::num_shards]
