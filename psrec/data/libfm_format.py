"""libfm / libsvm rows with a field map, e.g. Frappe: "<label> <id>:<value> <id>:<value> ...".

The label is binary: a number equal to 1 (positive), or to 0 or -1 (libfm's negative; both -> 0);
any other value ("3", "0.5") makes the line bad. Each token's feature id belongs to the
field whose `DataSource.field_ranges` range holds it; the schema's sparse features are named after
fields. A single-valued feature needs exactly one id per row; a multi-valued one takes any number.
Ids pass through (`hashed=False`: the global libfm feature id) or are hashed per namespace. Values
must be numbers but are not used (one-hot data). Tokens are separated by spaces or tabs; lines end
with LF or CRLF.

Parsing is one numba kernel over a block of lines (`parse_block`) with a plain-Python oracle
(`parse_line_reference`) that the tests compare it with; a malformed line (bad label, a token that
is not `id:number`, an id in no field, a field count a single-valued feature cannot take) raises
with file, line and text, or is skipped under `on_error: skip`. A file cut short or corrupt keeps the
lines before the damage (see `psrec.data.lines`); a file without lines is an error unless the
source sets `allow_empty`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa

from psrec.data.errors import BadRows
from psrec.data.features import ROW_ID
from psrec.data.lines import (
    DamagedStream,
    LineBlock,
    LineCounter,
    check_not_empty,
    line_blocks,
    report_damage,
)
from psrec.data.schema import DataSource, Schema
from psrec.data.units import Unit, row_id_base, text_units

logger = logging.getLogger(__name__)

OK, BAD_LABEL, BAD_TOKEN, NO_LABEL, NOT_BINARY = 0, 1, 2, 3, 4
_REASONS = {
    BAD_LABEL: "label is not a number",
    BAD_TOKEN: "token is not id:number",
    NO_LABEL: "no label",
    NOT_BINARY: "label is not 1, 0 or -1 (labels are binary)",
}
_MAX_ID_DIGITS = 18


@numba.njit(cache=True, nogil=True, inline="always")
def _space(byte: np.uint8) -> bool:
    return byte == 32 or byte == 9


@numba.njit(cache=True, nogil=True)
def _number_end(data: np.ndarray, position: int, end: int) -> int:
    """End of the number starting at `position`, or -1 if there is none."""
    if position < end and (data[position] == 45 or data[position] == 43):  # - +
        position += 1
    digits = 0
    while position < end and 48 <= data[position] <= 57:
        digits += 1
        position += 1
    if position < end and data[position] == 46:  # .
        position += 1
        while position < end and 48 <= data[position] <= 57:
            digits += 1
            position += 1
    if digits == 0:
        return -1
    if position < end and (data[position] == 101 or data[position] == 69):  # e E
        position += 1
        if position < end and (data[position] == 45 or data[position] == 43):
            position += 1
        exponent_digits = 0
        while position < end and 48 <= data[position] <= 57:
            exponent_digits += 1
            position += 1
        if exponent_digits == 0:
            return -1
    if position < end and not _space(data[position]):
        return -1
    return position


@numba.njit(cache=True, nogil=True)
def _binary_label(data: np.ndarray, position: int, end: int) -> int:
    """1 for the number [position, end) equal to 1, 0 for one equal to 0 or -1, -1 for any other.

    Exact in decimal, with no float rounding: "1.000", "1e0", "10e-1", "-0" are labels; "3", "0.5",
    "1e-999" are not. `end` is where `_number_end` found the number to end.
    """
    negative = False
    if data[position] == 45 or data[position] == 43:  # - +
        negative = data[position] == 45
        position += 1
    digits = 0
    integer_digits = 0
    nonzero = 0
    nonzero_digit = 0
    nonzero_index = -1  # among all digits, integer part first
    point = False
    while position < end and (48 <= data[position] <= 57 or data[position] == 46):
        if data[position] == 46:
            point = True
        else:
            if data[position] != 48:
                nonzero += 1
                nonzero_digit = data[position] - 48
                nonzero_index = digits
            digits += 1
            if not point:
                integer_digits += 1
        position += 1
    exponent = 0
    if position < end:  # e or E
        position += 1
        exponent_negative = data[position] == 45
        if data[position] == 45 or data[position] == 43:
            position += 1
        while position < end:
            if exponent < 1_000_000:  # saturates: a power that large is not 0 either way
                exponent = exponent * 10 + (data[position] - 48)
            position += 1
        if exponent_negative:
            exponent = -exponent
    if nonzero == 0:
        return 0
    if nonzero > 1 or nonzero_digit != 1 or integer_digits - 1 - nonzero_index + exponent != 0:
        return -1
    return 0 if negative else 1


@numba.njit(cache=True, nogil=True)
def parse_block(
    data: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(labels, counts, ids, status, error_at) of each line [starts[i], ends[i]) of `data`.

    ids holds the ids of the good lines only, line after line; counts is 0 for bad lines.
    error_at: byte index (in data) of the offending token of a bad line.
    """
    lines = starts.size
    labels = np.zeros(lines, dtype=np.float32)
    counts = np.zeros(lines, dtype=np.int32)
    status = np.zeros(lines, dtype=np.int8)
    error_at = np.zeros(lines, dtype=np.int64)
    capacity = 0
    for i in range(starts[0] if lines else 0, ends[lines - 1] if lines else 0):
        capacity += data[i] == 58  # ':'
    ids = np.empty(capacity, dtype=np.int64)
    written = 0
    for line in range(lines):
        position, end = starts[line], ends[line]
        line_start_written = written
        while position < end and _space(data[position]):
            position += 1
        if position >= end:
            status[line] = NO_LABEL
            error_at[line] = starts[line]
            continue
        after = _number_end(data, position, end)
        if after < 0:
            status[line] = BAD_LABEL
            error_at[line] = position
            continue
        label = _binary_label(data, position, after)
        if label < 0:
            status[line] = NOT_BINARY
            error_at[line] = position
            continue
        labels[line] = label
        position = after
        while True:
            while position < end and _space(data[position]):
                position += 1
            if position >= end:
                break
            token = position
            identifier = 0
            digits = 0
            while position < end and 48 <= data[position] <= 57 and digits <= _MAX_ID_DIGITS:
                identifier = identifier * 10 + (data[position] - 48)
                digits += 1
                position += 1
            if digits == 0 or digits > _MAX_ID_DIGITS or position >= end or data[position] != 58:
                status[line] = BAD_TOKEN
                error_at[line] = token
                break
            after = _number_end(data, position + 1, end)
            if after < 0:
                status[line] = BAD_TOKEN
                error_at[line] = token
                break
            ids[written] = identifier
            written += 1
            position = after
        if status[line] != OK:
            written = line_start_written
        else:
            counts[line] = written - line_start_written
    return labels, counts, ids[:written], status, error_at


_TOKEN = re.compile(r"^(\d{1,18}):([+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)$", re.ASCII)
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$", re.ASCII)


def parse_line_reference(line: str) -> tuple[float, list[int]] | str:
    """Plain-Python oracle of `parse_block` for one line: (label, ids) or the reason it is bad."""
    tokens = [token for token in re.split(r"[ \t]+", line) if token]  # spaces and tabs only, as the kernel
    if not tokens:
        return _REASONS[NO_LABEL]
    if not _NUMBER.match(tokens[0]):
        return _REASONS[BAD_LABEL]
    label = Decimal(tokens[0])
    if label not in (1, 0, -1):
        return _REASONS[NOT_BINARY]
    ids = []
    for token in tokens[1:]:
        match = _TOKEN.match(token)
        if not match:
            return _REASONS[BAD_TOKEN]
        ids.append(int(match[1]))
    return (1.0 if label == 1 else 0.0), ids


class LibfmFormat:
    """Reads libfm units; see `psrec.data.reader.FormatReader`."""

    def __init__(self, files: list[Path], source: DataSource, schema: Schema, errors: BadRows) -> None:
        assert source.field_ranges is not None  # DataSource guarantees it for libfm
        if schema.dense or schema.sequences:
            raise ValueError(
                "libfm data has sparse fields only: remove the schema's dense and sequence features"
            )
        if len(schema.label_names) != 1:
            raise ValueError("libfm data has one label column")
        unknown = [f.name for f in schema.sparse if f.name not in source.field_ranges]
        if unknown:
            raise ValueError(
                f"sparse features {unknown} are not fields of field_ranges {sorted(source.field_ranges)}"
            )
        self.files = files
        self.source = source
        self.schema = schema
        self.errors = errors
        ranges = sorted((low, high, name) for name, (low, high) in source.field_ranges.items())
        self.field_names = [name for _, _, name in ranges]
        self.lows = np.array([low for low, _, _ in ranges], dtype=np.int64)
        self.highs = np.array([high for _, high, _ in ranges], dtype=np.int64)
        self._counters: dict[str, LineCounter] = {}

    def units(self) -> list[Unit]:
        return [
            unit
            for index, path in enumerate(self.files)
            if check_not_empty(str(path), allow_empty=self.source.allow_empty)
            for unit in text_units(index, path, self.source.split_bytes)
        ]

    def _report(self, block: LineBlock, line: int, path: str, reason: str) -> None:
        counter = self._counters.setdefault(path, LineCounter(path))
        offset = block.offset + int(block.starts[line])
        self.errors.report(path, lambda: f"line {counter(offset)}", reason, block.line(line))

    def _table(self, block: LineBlock, path: str) -> tuple[pa.Table, np.ndarray] | None:
        data = np.frombuffer(block.data, dtype=np.uint8)
        labels, counts, ids, status, error_at = parse_block(data, block.starts, block.ends)
        line_of_id = np.repeat(np.arange(counts.size), counts)
        field = np.searchsorted(self.lows, ids, side="right") - 1
        outside = (field < 0) | (ids > self.highs[np.maximum(field, 0)])
        bad = status != OK
        for line in np.flatnonzero(bad):
            token = block.data[int(error_at[line]) : int(block.ends[line])].split(maxsplit=1)
            shown = f" ({token[0].decode(errors='replace')!r})" if token else ""
            self._report(block, int(line), path, _REASONS[int(status[line])] + shown)
        for line in np.unique(line_of_id[outside]):
            first = ids[outside & (line_of_id == line)][0]
            self._report(block, int(line), path, f"feature id {first} is in no field of field_ranges")
            bad[line] = True
        field = np.where(outside, 0, field)
        per_field = np.zeros((counts.size, len(self.field_names)), dtype=np.int64)
        np.add.at(per_field, (line_of_id, field), 1)
        columns: dict[str, pa.Array] = {}
        single_checks = []
        for feature in self.schema.sparse:
            index = self.field_names.index(feature.name)
            if not feature.multi_valued:
                wrong = ~bad & (per_field[:, index] != 1)
                single_checks.append((feature.name, index, wrong))
        for name, index, wrong in single_checks:
            for line in np.flatnonzero(wrong & ~bad):
                self._report(
                    block, int(line), path, f"field {name!r} has {per_field[line, index]} ids, expected 1"
                )
                bad[line] = True
        keep_lines = np.flatnonzero(~bad)
        if keep_lines.size == 0:
            return None
        keep_ids = ~bad[line_of_id] & ~outside
        for feature in self.schema.sparse:
            index = self.field_names.index(feature.name)
            selected = keep_ids & (field == index)
            values = ids[selected]
            if feature.multi_valued:
                offsets = np.zeros(keep_lines.size + 1, dtype=np.int32)
                np.cumsum(per_field[keep_lines, index], out=offsets[1:])
                columns[feature.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            else:
                columns[feature.name] = pa.array(values)
        table = pa.table({self.schema.label_names[0]: pa.array(labels[keep_lines]), **columns})
        return table, keep_lines

    def read(self, unit: Unit, after: int | None) -> Iterator[pa.Table]:
        """The rows of `unit` whose line starts after byte `after` (all when None), with `__row_id`."""
        base = row_id_base(unit.file_index)
        try:
            for block in line_blocks(unit, after=after):
                parsed = self._table(block, unit.path)
                if parsed is None:
                    continue
                table, lines = parsed
                row_ids = base + block.offset + block.starts[lines]
                yield table.append_column(ROW_ID, pa.array(row_ids, pa.int64()))
        except DamagedStream as damage:
            report_damage(
                self.errors, self._counters.setdefault(unit.path, LineCounter(unit.path)), unit, damage
            )
