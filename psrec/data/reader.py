"""`open_reader`: a shard's rows as `Batch`es, shuffled in a bounded window, resumable, prefetched.

Data flow (each step is a plain function; the format readers are in their own modules)::

    units of the dataset (psrec.data.units) -> this shard's units (every N-th; order shuffled by seed)
      -> stream of Arrow tables, each from one unit (format reader: parquet / text / libfm / interactions),
         hashed and transformed (features.prepare_table)
      -> windows: with a shuffle buffer S, the next S rows in stream order, permuted by rng(seed, shard, w)
      -> batches of `batch_size` rows -> features.table_to_batch -> Batch (+ the position after it)
      -> background thread, `prefetch` batches ahead -> the trainer

Position (plain JSON, what a checkpoint stores) after a batch: the stream position (unit index in the
shard's order, file offset of the last row read before it) where the current window starts, the
window's number and how many of its rows have been delivered. Reopening with it re-reads that window,
permutes it the same way and drops the rows already delivered: exactly the remaining rows of the
shard, in the same order. Without shuffling a window is simply each table read, and the position is
the last row delivered.

When the number of readers changes in the middle of an epoch, `psrec.data.shares.redistribute`
deals the rows not read yet to the new readers: each then reads an explicit share (parts: unit
lists with their own shuffle key and start), carried in its positions, so a checkpoint resumes it.

A `PreparedCache` passed to every epoch's reader keeps the prepared tables of each unit read whole
(decoded, hashed, transformed: everything before the shuffle), so later epochs skip the format
reader and `prepare_table`, as tf.data's `cache()` does; windows, shuffles, batches and positions are
built from them exactly as from a fresh read. It keeps what reading the unit counted too (rows
skipped, values filled, a failed unit), so every epoch's `stats()` counts the same. The
interactions format is never cached (it draws new negatives each epoch).

Bad input (see `psrec.data.errors`): bad rows raise or are skipped and counted; a unit that cannot be
read to its end raises or is counted apart, keeping the rows before the damage; dense values filled
or clipped are counted per feature. `BatchReader.stats()` reports all of it.

Typical use, one reader per epoch::

    for epoch in range(epochs):
        with open_reader(source, schema, batch_size=4096, shard=rank, num_shards=world,
                         shuffle_buffer=100_000, seed=epoch) as reader:
            for batch in reader:
                train_step(batch)
                checkpoint_data = reader.position()  # store with the model
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from psrec.data.background import BackgroundIterator, InputGate, checkpoint
from psrec.data.batch import Batch
from psrec.data.errors import BadRows, Tally
from psrec.data.features import ROW_ID, is_prepared, prepare_table, table_to_batch
from psrec.data.schema import DataSource, Schema
from psrec.data.shares import START_KEYS, standard_units, zero_start
from psrec.data.units import OFFSET_MASK, Unit, expand_paths, local_files, shard_units
from psrec.storage import Location

logger = logging.getLogger(__name__)

POSITION_VERSION = 1
READY_POLL_S = 0.005  # how often `BatchReader.wait_ready` looks


class FormatReader(Protocol):
    """What each format provides: its units, and the rows of one unit after a file offset."""

    def units(self) -> list[Unit]: ...

    def read(self, unit: Unit, after: int | None) -> Iterator[pa.Table]: ...


def make_format_reader(
    source: DataSource, schema: Schema, files: Sequence[Location], errors: BadRows, *, seed: int = 0
) -> FormatReader:
    """The format reader for `source` (imports lazily: each format is its own module).

    `seed` only matters for interactions, whose training rows carry sampled negatives. Only Parquet
    reads from a store (`files` holding URIs); the other formats raise ValueError for one.
    """
    if source.format == "parquet":
        from psrec.data.parquet_format import ParquetFormat

        return ParquetFormat(files, schema, errors, allow_empty=source.allow_empty)
    if source.format in ("csv", "criteo_tsv"):
        from psrec.data.text_format import DelimitedFormat

        return DelimitedFormat(local_files(files), source, schema, errors)
    if source.format == "libfm":
        from psrec.data.libfm_format import LibfmFormat

        return LibfmFormat(local_files(files), source, schema, errors)
    from psrec.data.sequences import InteractionsFormat

    return InteractionsFormat(
        local_files(files),
        schema,
        errors,
        seed=seed,
        allow_empty=source.allow_empty,
        holdout=source.holdout,
        negatives_from=source.negatives_from,
    )


@dataclass
class _Window:
    """Rows delivered in order; `start`/`end`: stream positions (unit index, offset) around them."""

    index: int
    table: pa.Table
    start: tuple[int, int | None]
    end: tuple[int, int | None]
    shuffled: bool
    unit: int = 0  # unshuffled windows come from one unit
    part: int = 0  # the part of the reader's share (`psrec.data.shares`) the window is of
    skip: int = 0  # rows at its start delivered before (a resumed window)

    def position_after(self, consumed: int) -> dict[str, Any]:
        """Where the reader stands after `consumed` rows of this window; ``end_unit`` is the unit the
        window ends in while some of its rows are still to come (`psrec.data.shares` splits there)."""
        part = {"part": self.part}
        if consumed >= self.table.num_rows:
            unit = self.end[0]
            return {
                "window": self.index + 1,
                "unit": unit,
                "after": self.end[1],
                "consumed": 0,
                "end_unit": unit,
                **part,
            }
        if self.shuffled:
            return {
                "window": self.index,
                "unit": self.start[0],
                "after": self.start[1],
                "consumed": consumed,
                "end_unit": self.end[0],
                **part,
            }
        last = int(self.table.column(ROW_ID)[consumed - 1].as_py()) & OFFSET_MASK
        return {
            "window": self.index,
            "unit": self.unit,
            "after": last,
            "consumed": 0,
            "end_unit": self.unit,
            **part,
        }


class PreparedCache:
    """Prepared tables per unit, kept across epochs in memory (see the module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[Unit, list[pa.Table]] = {}
        self._tallies: dict[Unit, Tally] = {}
        self.nbytes = 0

    def get(self, unit: Unit) -> list[pa.Table] | None:
        return self._tables.get(unit)

    def tally(self, unit: Unit) -> Tally:
        """What reading `unit` counted (skipped rows, filled values, a failed unit)."""
        return self._tallies.get(unit, Tally())

    def put(self, unit: Unit, tables: list[pa.Table], tally: Tally | None = None) -> None:
        if unit not in self._tables:
            self._tables[unit] = tables
            self._tallies[unit] = tally or Tally()
            self.nbytes += sum(table.nbytes for table in tables)

    def __len__(self) -> int:
        return len(self._tables)


def _prepare(schema: Schema, table: pa.Table, errors: BadRows, unit: Unit) -> pa.Table:
    try:
        return prepare_table(schema, table, errors)
    except (pa.ArrowException, ValueError, TypeError) as error:  # the readers' checks should prevent it
        where = f"row group {unit.row_group}" if unit.row_group >= 0 else f"bytes {unit.start}-{unit.stop}"
        raise ValueError(f"{unit.path}, {where}: cannot prepare its rows for the schema: {error}") from error


def _stream(
    reader: FormatReader,
    schema: Schema,
    units: list[Unit],
    unit: int,
    after: int | None,
    errors: BadRows,
    cache: PreparedCache | None = None,
) -> Iterator[tuple[int, pa.Table]]:
    """(unit index, prepared table) of the units from `unit` on, starting after offset `after`.

    With a cache, a unit read from its start is served from it (and what reading it counted is
    counted again), or read and then kept (only once read to its end: a reader closed midway stores
    nothing partial)."""
    for index in range(unit, len(units)):
        first_after = after if index == unit else None
        whole = first_after is None  # read from its start: served from / kept in the cache
        cached = cache.get(units[index]) if cache is not None and whole else None
        if cache is not None and cached is not None:
            errors.replay(cache.tally(units[index]))
            for table in cached:
                yield index, table
            continue
        before = errors.snapshot() if cache is not None and whole else None
        prepared: list[pa.Table] = []
        for table in reader.read(units[index], first_after):
            if table.num_rows:
                if not is_prepared(table):  # `psrec data convert --prepared` did it already
                    checkpoint()  # a held input gate pauses the read between decoding and preparing
                    table = _prepare(schema, table, errors, units[index])
                prepared.append(table)
                yield index, table
        if cache is not None and before is not None:
            cache.put(units[index], prepared, errors.snapshot().since(before))


def _last_offset(table: pa.Table) -> int:
    return int(table.column(ROW_ID)[table.num_rows - 1].as_py()) & OFFSET_MASK


def windows(
    stream: Iterator[tuple[int, pa.Table]],
    *,
    start: tuple[int, int | None],
    first_index: int,
    shuffle_buffer: int,
    permutation: Callable[[int, int], np.ndarray],
    part: int = 0,
) -> Iterator[_Window]:
    """Group the stream into windows; with `shuffle_buffer` > 0, `permutation(window, n)` orders each."""
    if shuffle_buffer <= 0:
        for unit, table in stream:
            end = (unit, _last_offset(table))
            yield _Window(first_index, table, start, end, shuffled=False, unit=unit, part=part)
            start = end
        return
    index = first_index
    pending: list[tuple[int, pa.Table]] = []
    pending_rows = 0
    exhausted = False
    while not exhausted or pending_rows:
        while pending_rows < shuffle_buffer and not exhausted:
            item = next(stream, None)
            if item is None:
                exhausted = True
            else:
                pending.append(item)
                pending_rows += item[1].num_rows
        if not pending_rows:
            return
        taken: list[tuple[int, pa.Table]] = []
        count = 0
        while pending and count < shuffle_buffer:
            unit, table = pending.pop(0)
            room = shuffle_buffer - count
            if table.num_rows > room:
                pending.insert(0, (unit, table.slice(room)))
                table = table.slice(0, room)
            taken.append((unit, table))
            count += table.num_rows
        pending_rows -= count
        rows = pa.concat_tables([table for _, table in taken])
        end = (taken[-1][0], _last_offset(taken[-1][1]))
        ordered = rows.take(pa.array(permutation(index, rows.num_rows)))
        yield _Window(index, ordered, start, end, shuffled=True, part=part)
        start = end
        index += 1


def batches(
    window_iterator: Iterator[_Window], *, batch_size: int, drop_last: bool, skip_first: int = 0
) -> Iterator[tuple[pa.Table, dict[str, Any]]]:
    """Cut windows into tables of `batch_size` rows, each with the position after it."""
    pending: list[pa.Table] = []
    count = 0
    position: dict[str, Any] = {}
    for number, window in enumerate(window_iterator):
        offset = max(skip_first if number == 0 else 0, window.skip)
        while offset < window.table.num_rows:
            take = min(batch_size - count, window.table.num_rows - offset)
            pending.append(window.table.slice(offset, take))
            count += take
            offset += take
            position = window.position_after(offset)
            if count == batch_size:
                yield pa.concat_tables(pending), position
                pending, count = [], 0
    if pending and not drop_last:
        yield pa.concat_tables(pending), position


class BatchReader:
    """Iterable of `Batch`; `position()`, `stats()`, `close()` (also a context manager)."""

    def __init__(
        self,
        produce: Callable[[], Iterator[tuple[Batch, dict[str, Any]]]],
        *,
        position: dict[str, Any],
        prefetch: int,
        errors: BadRows,
        info: dict[str, Any],
        gate: InputGate | None = None,
        live: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self._produce = produce
        self._live = live  # stats that change while the reader waits (a stream's lag), from its position
        self._gate = gate
        self._position = position
        self._prefetch = prefetch
        self._errors = errors
        self._info = info
        self._rows = 0
        self._batches = 0
        self._started = False
        self.ended = False  # every batch was delivered (a stream source ended, e.g. idle_timeout_s)
        self._background: BackgroundIterator[tuple[Batch, dict[str, Any]]] | None = None

    def __iter__(self) -> Iterator[Batch]:
        if self._started:
            raise RuntimeError("a BatchReader is iterated once; reopen it (with position=...) to read again")
        self._started = True
        if self._prefetch > 0:  # reading starts now (`wait_ready` can wait for the first batch)
            self._background = BackgroundIterator(
                self._produce, depth=self._prefetch, name="psrec-prefetch", gate=self._gate
            )
        return self._iterate()

    def _deliver(self, batch: Batch, position: dict[str, Any]) -> Batch:
        self._position = {**self._position, **position}
        self._rows += batch.batch_size
        self._batches += 1
        return batch

    def _iterate(self) -> Iterator[Batch]:
        if self._prefetch <= 0:
            for batch, position in self._produce():
                yield self._deliver(batch, position)
            self.ended = True
            return
        background = self._background
        if background is None:  # closed before the first batch
            return
        try:
            for batch, position in background:
                yield self._deliver(batch, position)
            self.ended = True
        finally:  # the consumer stopped early (or the generator was collected): stop the thread
            self.close()

    def position(self) -> dict[str, Any]:
        """JSON-serialisable position after the last batch delivered (pass to `open_reader`)."""
        return dict(self._position)

    def stats(self) -> dict[str, Any]:
        """Counts so far and the dataset's shape (plain JSON).

        - rows_read (delivered in batches), batches;
        - rows_skipped and skipped_samples (file, location "line N" / "row N", reason, text of the
          first bad rows skipped);
        - units_failed, bytes_lost (of the files as stored), rows_lost (Parquet row groups only) and
          failed_units (file, location, reason, bytes_lost, rows_lost of each unit not read to its
          end; the rows before the damage were delivered);
        - dense_values_missing, dense_values_filled (NaN/infinite -> fill), dense_values_clipped
          (beyond float32 -> nearest float32), and per feature: dense_values {name: {missing,
          filled, clipped}};
        - files, units, shard_units, shard_rows (rows of this shard; Parquet only, else None).
        """
        return {
            **self._info,
            **(self._live(self.position()) if self._live is not None else {}),
            "rows_read": self._rows,
            "batches": self._batches,
            **self._errors.snapshot().as_dict(),
        }

    def wait_ready(self, timeout: float) -> bool:
        """True when the next batch (or the end) is read already, so that iterating does not wait;
        waits up to `timeout` seconds for it. False before iteration started or without prefetch."""
        deadline = time.monotonic() + timeout
        while True:
            background = self._background
            if background is not None and background.ready():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(READY_POLL_S, remaining))

    def close(self) -> None:
        """Stop the prefetch thread (safe to call twice)."""
        if self._background is not None:
            self._background.close()
            self._background = None

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_position(position: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if position.get(key) != value:
            raise ValueError(
                f"position does not belong to this reader: {key} is {position.get(key)!r} there, "
                f"{value!r} here (a position resumes the same dataset, shard, seed and shuffle buffer)"
            )


def _share(
    position: dict[str, Any] | None,
    all_units: list[Unit],
    shard: int,
    num_shards: int,
    *,
    seed: int,
    shuffled: bool,
) -> list[dict[str, Any]]:
    """The parts this reader reads: an explicit share from `position`, else the standard one."""
    if position is None or "share" not in position:
        count = len(shard_units(all_units, shard, num_shards))
        units = standard_units(shard, num_shards, count, seed=seed, shuffled=shuffled)
        return [{"units": units, "key": [seed, shard], "generation": 0, "start": zero_start()}]
    parts = position["share"]
    for part in parts:
        if any(not 0 <= int(index) < len(all_units) for index in part["units"]):
            raise ValueError(
                f"position does not belong to this reader: its share names units beyond the dataset's "
                f"{len(all_units)} (a position resumes the same dataset)"
            )
    return list(parts)


def open_reader(
    source: DataSource,
    schema: Schema,
    *,
    batch_size: int,
    base_dir: str | Path = ".",
    shard: int = 0,
    num_shards: int = 1,
    shuffle_buffer: int = 0,
    seed: int = 0,
    position: dict[str, Any] | None = None,
    prefetch: int = 2,
    drop_last: bool = False,
    gate: InputGate | None = None,
    cache: PreparedCache | None = None,
) -> BatchReader:
    """Open shard `shard` of `num_shards` of `source` as batches; see the module docstring.

    base_dir: what relative paths of `source` are relative to. shuffle_buffer: rows per shuffle
    window (0: file order). seed: shuffle (and interaction negatives) seed; pass a new one per epoch,
    e.g. `base_seed * 1000 + epoch`. position: `BatchReader.position()` of an earlier reader with the
    same source, shard, num_shards, seed and shuffle_buffer (batch_size may differ). prefetch: batches
    prepared ahead in a background thread (0: in the caller's thread). drop_last: leave out a final
    batch smaller than batch_size. gate: the prefetch thread waits at it before each batch (see
    `psrec.data.background.InputGate`). cache: where prepared rows are kept for the next epoch's
    reader (pass the same one each epoch; ignored for the interactions format).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
    errors = BadRows(source.on_error)
    files = expand_paths(source.paths, base_dir)
    format_reader = make_format_reader(source, schema, files, errors, seed=seed)
    if source.format == "interactions":
        cache = None  # its rows depend on the seed (negatives are drawn anew each epoch)
    all_units = format_reader.units()
    parts = _share(position, all_units, shard, num_shards, seed=seed, shuffled=shuffle_buffer > 0)
    units = [all_units[index] for part in parts for index in part["units"]]
    identity = {
        "version": POSITION_VERSION,
        "format": source.format,
        "shard": shard,
        "num_shards": num_shards,
        "num_units": len(units),
        "seed": seed,
        "shuffle_buffer": shuffle_buffer,
    }
    start: dict[str, Any] = {"part": 0, **zero_start()}
    if position is not None:
        _check_position(position, identity)
        start = {
            "part": 0,
            **zero_start(),
            **{k: position[k] for k in ("part", *START_KEYS) if k in position},
        }
    if position is not None and "share" in position:
        identity["share"] = position["share"]

    def produce() -> Iterator[tuple[Batch, dict[str, Any]]]:
        def grouped() -> Iterator[_Window]:
            for number in range(int(start["part"]), len(parts)):
                part = parts[number]
                at = start if number == int(start["part"]) else {**zero_start(), **part["start"]}
                part_units = [all_units[index] for index in part["units"]]
                key = [int(value) for value in part["key"]]

                def permutation(window: int, rows: int, key: list[int] = key) -> np.ndarray:
                    return np.random.default_rng([*key, window]).permutation(rows)

                stream = _stream(format_reader, schema, part_units, at["unit"], at["after"], errors, cache)
                skip = int(at["consumed"] or 0)  # rows of its first window delivered before
                for window in windows(
                    stream,
                    start=(at["unit"], at["after"]),
                    first_index=at["window"],
                    shuffle_buffer=shuffle_buffer,
                    permutation=permutation,
                    part=number,
                ):
                    window.skip, skip = skip, 0
                    yield window

        for table, after in batches(grouped(), batch_size=batch_size, drop_last=drop_last):
            yield table_to_batch(schema, table), after

    # Parquet knows its row counts from the footers; text formats would need a pass.
    shard_rows = sum(u.stop - u.start for u in units) if source.format == "parquet" else None
    info = {"files": len(files), "units": len(all_units), "shard_units": len(units), "shard_rows": shard_rows}
    return BatchReader(
        produce, position={**identity, **start}, prefetch=prefetch, errors=errors, info=info, gate=gate
    )


class StreamWindow:
    """A stream reader's batches for training in chunks: iteration stops (this time) when no batch
    arrived for `wait_seconds`, and goes on with the next batch when iterated again. Lets a trainer
    reading a stream that never ends hand control back between chunks (`training.mode: continuous`)."""

    def __init__(self, reader: BatchReader, *, wait_seconds: float) -> None:
        self._reader = reader
        self._batches = iter(reader)
        self.wait_seconds = wait_seconds

    def __iter__(self) -> StreamWindow:
        return self

    def __next__(self) -> Batch:
        if not self._reader.wait_ready(self.wait_seconds):
            raise StopIteration
        return next(self._batches)
