"""Delimited text rows: Criteo raw TSV (Kaggle and Terabyte layout) and CSV with or without a header.

Blocks of whole lines (`psrec.data.lines`) are parsed by pyarrow's multi-threaded CSV reader into
the schema's columns (`features.text_column_types`: labels and dense as float64, hashed sparse as
text, pass-through ids as int64; empty = missing). A block that fails to parse is bisected, still
with pyarrow, down to the lines that fail on their own: those are the bad rows, reported with file,
line number and text (or skipped), and every other line of the block is kept. So a bad row costs
a few extra parses of its block, and good input pays nothing for the line precision. Rows that
parse are then checked for values no model may see (`features.bad_rows`: labels other than 0 or 1,
dense values a feature's `invalid` refuses, bad pass-through ids).

A file that is cut short or corrupt (`lines.DamagedStream`) keeps the rows before the damage; its
unfinished last line is a bad row, and the unit is reported as failed (`BadRows.report_unit`). A
file with no rows is an error unless the source sets `allow_empty`.

Criteo TSV has no quoting (a `"` is data); CSV uses `"` quotes but no line breaks inside values. A
carriage return inside a line (not ending it as CRLF) makes the line a bad row: pyarrow would take
it for a line end and split the line, or merge it with an empty one.
"""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from psrec.data.errors import BadRows, Policy
from psrec.data.features import ROW_ID, bad_rows, text_column_types
from psrec.data.lines import (
    DamagedStream,
    LineBlock,
    LineCounter,
    carriage_return_lines,
    check_not_empty,
    header_line,
    line_blocks,
    report_damage,
)
from psrec.data.schema import DataSource, Schema
from psrec.data.units import Unit, row_id_base, text_units

logger = logging.getLogger(__name__)

_COLUMN_COUNT = re.compile(r"Expected (\d+) columns, got (\d+)")
_CONVERSION = re.compile(r"In CSV column #(\d+): .*?conversion error to (\w+): invalid value '(.*)'", re.S)


def parse_lines(
    data: bytes,
    names: list[str],
    types: dict[str, pa.DataType],
    *,
    delimiter: str,
    quoted: bool,
    threads: bool = True,
) -> pa.Table:
    """Lines of delimited text (columns `names` in order) parsed to the columns `types` names (see the
    module docstring; empty = missing). Raises pyarrow's ArrowInvalid for a line that does not parse
    (`parse_failure` says why, by column name).

    Single threaded, columns convert in order: a bad line's first bad column is the one named.
    """
    read = pa_csv.ReadOptions(column_names=names, use_threads=threads, block_size=1 << 20)
    parse = pa_csv.ParseOptions(delimiter=delimiter, quote_char='"' if quoted else False)
    convert = pa_csv.ConvertOptions(
        column_types=types,
        include_columns=list(types),
        null_values=[""],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    return pa_csv.read_csv(pa.py_buffer(data), read, parse, convert)


def parse_failure(error: Exception, names: list[str]) -> str:
    """Why `parse_lines` failed on a line, in the schema's words (column count, column name and text)."""
    message = str(error)
    match = _COLUMN_COUNT.search(message)
    if match:
        return f"expected {match[1]} columns, got {match[2]}"
    match = _CONVERSION.search(message)
    if match:
        index = int(match[1])
        name = names[index] if index < len(names) else f"#{index}"
        return f"column {name}: cannot parse {match[3]!r} as {match[2]}"
    return message.splitlines()[0] if message else type(error).__name__


class DelimitedFormat:
    """Reads csv / criteo_tsv units; see `psrec.data.reader.FormatReader`."""

    def __init__(self, files: list[Path], source: DataSource, schema: Schema, errors: BadRows) -> None:
        self.files = files
        self.source = source
        self.schema = schema
        self.errors = errors
        self.types = text_column_types(schema)
        self._columns: dict[str, list[str]] = {}
        self._counters: dict[str, LineCounter] = {}

    def units(self) -> list[Unit]:
        units = []
        for index, path in enumerate(self.files):
            has_rows = check_not_empty(
                str(path), allow_empty=self.source.allow_empty, skip_header=self.source.has_header
            )
            if has_rows:
                self._check_columns(str(path))
                units.extend(text_units(index, path, self.source.split_bytes))
        return units

    def _check_columns(self, path: str) -> list[str]:
        if path in self._columns:
            return self._columns[path]
        names = self.source.column_names
        if self.source.has_header:
            header = next(csv.reader([header_line(path)], delimiter=self.source.text_delimiter))
            if names is not None and header != names:
                raise ValueError(f"{path}: header {header} differs from the configured columns {names}")
            names = header
        assert names is not None  # DataSource guarantees names or a header
        missing = [name for name in self.types if name not in names]
        if missing:
            raise ValueError(f"{path}: schema columns {missing} are not in the file's columns {names}")
        self._columns[path] = names
        return names

    def _parse(self, data: bytes, path: str, threads: bool = True) -> pa.Table:
        names = self._check_columns(path)
        quoted = self.source.format == "csv"
        return parse_lines(
            data, names, self.types, delimiter=self.source.text_delimiter, quoted=quoted, threads=threads
        )

    def _reason(self, error: Exception, path: str) -> str:
        return parse_failure(error, self._columns[path])

    def _bisect(
        self, block: LineBlock, lines: np.ndarray, path: str, bad: list[int], stray: np.ndarray
    ) -> list[pa.Table]:
        """Tables of the good lines among `lines` (indices into the block), in order.

        A line that fails on its own is reported at once (so under on_error "raise" the first bad
        line of the block raises) and appended to `bad`. Lines in `stray` (a carriage return inside)
        are bad without a parse: one could split into two rows where another gives none.
        """
        held = np.isin(lines, stray)
        error: Exception = ValueError("a carriage return inside the line (lines end with LF or CRLF)")
        if not held.any():
            data = b"\n".join(block.data[int(block.starts[i]) : int(block.ends[i])] for i in lines)
            try:
                table = self._parse(data, path, threads=lines.size > 1)
                if table.num_rows == lines.size:
                    return [table]
                error = ValueError(f"{lines.size} line(s) parse as {table.num_rows} rows")
            except pa.ArrowInvalid as failure:
                error = failure
        if lines.size == 1:
            self._report(block, int(lines[0]), path, self._reason(error, path))
            bad.append(int(lines[0]))
            return []
        middle = lines.size // 2
        left = self._bisect(block, lines[:middle], path, bad, stray)
        return left + self._bisect(block, lines[middle:], path, bad, stray)

    def _parse_block(self, block: LineBlock, path: str) -> tuple[pa.Table | None, np.ndarray]:
        """(table, line index of each row) of a block; no table when every line is bad."""
        lines = np.arange(block.starts.size)
        stray = carriage_return_lines(block)  # pyarrow would take a lone CR for a line end
        if not stray.size:
            try:
                table = self._parse(block.data, path)
                if table.num_rows == lines.size:
                    return table, lines
            except pa.ArrowInvalid:
                pass
        bad: list[int] = []
        tables = self._bisect(block, lines, path, bad, stray)
        keep = np.setdiff1d(lines, np.array(bad, dtype=np.int64))
        return (pa.concat_tables(tables) if tables else None), keep

    def _report(
        self, block: LineBlock, line: int, path: str, reason: str, policy: Policy | None = None
    ) -> None:
        counter = self._counters.setdefault(path, LineCounter(path))
        offset = block.offset + int(block.starts[line])
        self.errors.report(path, lambda: f"line {counter(offset)}", reason, block.line(line), policy=policy)

    def read(self, unit: Unit, after: int | None) -> Iterator[pa.Table]:
        """The rows of `unit` whose line starts after byte `after` (all when None), with `__row_id`."""
        base = row_id_base(unit.file_index)
        skip_header = self.source.has_header and unit.start == 0
        try:
            for block in line_blocks(unit, after=after, skip_header=skip_header):
                table, lines = self._parse_block(block, unit.path)
                if table is None:
                    continue
                row_ids = base + block.offset + block.starts[lines]
                table = table.append_column(ROW_ID, pa.array(row_ids, pa.int64()))
                problems = bad_rows(self.schema, table)
                if problems:
                    keep = np.ones(table.num_rows, dtype=bool)
                    for index, reason, policy in problems:
                        self._report(block, int(lines[index]), unit.path, reason, policy)
                        keep[index] = False
                    table = table.filter(pa.array(keep))
                if table.num_rows:
                    yield table
        except DamagedStream as damage:
            report_damage(
                self.errors, self._counters.setdefault(unit.path, LineCounter(unit.path)), unit, damage
            )
