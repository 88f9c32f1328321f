"""Stream messages -> the raw table a file reader makes of the same rows: one message is one row.

A message is either a JSON object with the schema's column names, or one CSV/TSV line with the
columns in a given order (by default the schema's: labels, dense, sparse, sequences). Both decode to
the columns and Arrow types the text readers parse files to (`features.text_column_types`: labels
and dense float64, hashed sparse as text, pass-through ids int64, missing = null), so that
`features.prepare_table` and `features.table_to_batch` make the same `Batch` of a row whether it
came from a file or a stream. Lines parse with the text readers' own `text_format.parse_lines`.

JSON values, per column kind (anything else makes the message a bad row):

- label, dense: a number, or null / an absent key (missing; a label must not be);
- hashed sparse and sequence features: text, or an integer (hashed as its decimal text, like a file's
  "123"), or a list of them, joined with the feature's `separator` as a file holds it; null / absent
  hash like an empty field;
- pass-through ids (`hashed: false`, single-valued): an integer.

Keys the schema does not name are ignored, as a file's extra columns are. A message that is not one
line of valid UTF-8 text (empty, several lines, not JSON, not an object) is a bad row too. Each bad
row is reported through `BadRows` (raise or count and skip, `on_error`) with the message's place
(for Kafka: topic, partition and offset), then the rows that decode go through `features.bad_rows`,
the checks every file reader applies (labels 0 or 1, dense `invalid`, id ranges).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from psrec.data.errors import BadRows, Policy
from psrec.data.features import ROW_ID, bad_rows, text_column_types
from psrec.data.schema import Schema, SequenceFeature, SparseFeature
from psrec.data.text_format import parse_failure, parse_lines

MessageFormat = Literal["json", "csv", "tsv"]
INT64_MAX = (1 << 63) - 1
Locate = Callable[[int], tuple[str, str]]  # message index -> (source, location), as BadRows reports them
RESOLVE = "set on_error: skip to count bad messages and go on"


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


class MessageDecoder:
    """Decodes blocks of messages of one format for `schema` (see the module docstring).

    `columns`: the column order of CSV/TSV lines (default: the schema's); `delimiter`: default ","
    for csv and tab for tsv. Only csv lines may quote values (`"`), as in files.
    """

    def __init__(
        self,
        schema: Schema,
        message_format: MessageFormat,
        errors: BadRows,
        *,
        columns: Sequence[str] | None = None,
        delimiter: str | None = None,
    ) -> None:
        self.schema = schema
        self.message_format = message_format
        self.errors = errors
        self.types = text_column_types(schema)
        self.columns = list(columns) if columns is not None else [*schema.label_names, *schema.feature_names]
        missing = [name for name in self.types if name not in self.columns]
        if missing:
            raise ValueError(f"message columns {self.columns} lack the schema's columns {missing}")
        self.delimiter = delimiter or ("\t" if message_format == "tsv" else ",")
        features: list[SparseFeature | SequenceFeature] = [*schema.sparse, *schema.sequences]
        self.separators = {feature.name: feature.separator for feature in features}

    def decode(
        self, values: Sequence[bytes | None], row_ids: np.ndarray, locate: Locate
    ) -> tuple[pa.Table | None, np.ndarray]:
        """(table of the good messages' rows with `__row_id`, index of each row's message in `values`).

        `row_ids`: (len(values),) int64, the row id each message gets; `locate(i)` names message i
        for a bad-row report. No table when no message of the block is good.
        """
        problems: dict[int, tuple[str, Policy | None]] = {}  # message -> (reason, policy override)
        if self.message_format == "json":
            table, kept = self._json(values, problems)
        else:
            table, kept = self._lines(values, problems)
        if table is not None:
            table = table.append_column(ROW_ID, pa.array(row_ids[kept], pa.int64()))
            found = bad_rows(self.schema, table)
            if found:
                keep = np.ones(table.num_rows, dtype=bool)
                for problem in found:
                    problems[int(kept[problem.row])] = (problem.reason, problem.policy)
                    keep[problem.row] = False
                table, kept = table.filter(pa.array(keep)), kept[keep]
        for index in sorted(problems):  # in message order: under "raise" the first bad message raises
            reason, policy = problems[index]
            self._report(locate, index, reason, values[index], policy)
        return (table if table is not None and table.num_rows else None), kept

    def _report(
        self, locate: Locate, index: int, reason: str, value: bytes | None, policy: Policy | None = None
    ) -> None:
        source, location = locate(index)
        if (policy or self.errors.policy) == "raise":
            reason = f"{reason} ({RESOLVE})" if policy is None else reason
        self.errors.report(source, location, reason, _text(value), policy=policy)

    # -- CSV / TSV lines ------------------------------------------------------------------------

    def _parse(self, lines: Sequence[bytes]) -> pa.Table:
        return parse_lines(
            b"\n".join(lines),
            self.columns,
            self.types,
            delimiter=self.delimiter,
            quoted=self.message_format == "csv",
            threads=len(lines) > 1,
        )

    def _good_lines(
        self, lines: list[bytes], indices: np.ndarray, problems: dict[int, tuple[str, Policy | None]]
    ) -> list[tuple[pa.Table, np.ndarray]]:
        """Tables of the lines that parse, in order; a line that fails on its own is a bad row."""
        try:
            table = self._parse(lines)
            if table.num_rows == len(lines):
                return [(table, indices)]
            error: Exception = ValueError(f"{len(lines)} line(s) parse as {table.num_rows} rows")
        except pa.ArrowInvalid as failure:
            error = failure
        if len(lines) == 1:
            problems[int(indices[0])] = (parse_failure(error, self.columns), None)
            return []
        middle = len(lines) // 2
        left = self._good_lines(lines[:middle], indices[:middle], problems)
        return left + self._good_lines(lines[middle:], indices[middle:], problems)

    def _lines(
        self, values: Sequence[bytes | None], problems: dict[int, tuple[str, Policy | None]]
    ) -> tuple[pa.Table | None, np.ndarray]:
        lines: list[bytes] = []
        indices: list[int] = []
        for index, value in enumerate(values):
            line = (value or b"").removesuffix(b"\n").removesuffix(b"\r")
            if not line.strip():
                problems[index] = ("an empty message (one row per message expected)", None)
            elif b"\n" in line or b"\r" in line:
                problems[index] = ("a message of several lines (one row per message expected)", None)
            else:
                lines.append(line)
                indices.append(index)
        if not lines:
            return None, np.zeros(0, np.int64)
        parts = self._good_lines(lines, np.array(indices, dtype=np.int64), problems)
        if not parts:
            return None, np.zeros(0, np.int64)
        return pa.concat_tables([table for table, _ in parts]), np.concatenate([kept for _, kept in parts])

    # -- JSON objects ---------------------------------------------------------------------------

    def _json(
        self, values: Sequence[bytes | None], problems: dict[int, tuple[str, Policy | None]]
    ) -> tuple[pa.Table | None, np.ndarray]:
        rows: list[dict[str, Any]] = []
        indices: list[int] = []
        for index, value in enumerate(values):
            try:
                row = json.loads(value or b"")
            except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
                problems[index] = (f"not a JSON object: {error}", None)
                continue
            if not isinstance(row, dict):
                problems[index] = (f"a JSON object expected, got {type(row).__name__}", None)
                continue
            rows.append(row)
            indices.append(index)
        wrong: dict[int, str] = {}  # row -> reason
        arrays = {name: self._json_column(name, kind, rows, wrong) for name, kind in self.types.items()}
        kept = np.array(indices, dtype=np.int64)
        if wrong:
            for row, reason in wrong.items():
                problems[int(kept[row])] = (reason, None)
            keep = np.ones(len(rows), dtype=bool)
            keep[list(wrong)] = False
            kept = kept[keep]
            arrays = {name: array.filter(pa.array(keep)) for name, array in arrays.items()}
        if not kept.size:
            return None, kept
        return pa.table(arrays), kept

    def _json_column(
        self, name: str, kind: pa.DataType, rows: list[dict[str, Any]], problems: dict[int, str]
    ) -> pa.Array:
        """Column `name` of the objects as Arrow type `kind`; a value of the wrong kind is recorded in
        `problems` (row -> reason; the row's first problem is kept) and stands as null meanwhile."""
        values = [row.get(name) for row in rows]
        if kind == pa.float64():
            if all(type(value) in (float, int) or value is None for value in values):
                try:
                    return pa.array(values, kind)
                except (OverflowError, pa.ArrowInvalid):
                    pass
            fixed: list[Any] = []
            for row, value in enumerate(values):
                number = _as_number(value)
                if number is _BAD:
                    problems.setdefault(row, f"column {name}: expected a number or null, got {value!r}")
                    number = None
                fixed.append(number)
            return pa.array(fixed, kind)
        if kind == pa.int64():
            if all(type(value) is int and 0 <= value <= INT64_MAX or value is None for value in values):
                return pa.array(values, kind)
            fixed = []
            for row, value in enumerate(values):
                if value is not None and type(value) is not int:
                    problems.setdefault(row, f"column {name}: expected an integer id, got {value!r}")
                    value = None
                elif value is not None and not -INT64_MAX <= value <= INT64_MAX:
                    problems.setdefault(row, f"{name}: id {value} outside [0, 2**48)")
                    value = None
                fixed.append(value)
            return pa.array(fixed, kind)
        if all(type(value) is str or value is None for value in values):
            return pa.array(values, kind)
        separator = self.separators.get(name, "|")
        fixed = []
        for row, value in enumerate(values):
            text = _as_text(value, separator)
            if text is None and value is not None:
                problems.setdefault(
                    row, f"column {name}: expected text, an integer or a list of them, got {value!r}"
                )
            fixed.append(text)
        return pa.array(fixed, kind)


_BAD = object()


def _as_number(value: Any) -> Any:
    """A float for a JSON number, None for null, `_BAD` for anything else (booleans included)."""
    if value is None:
        return None
    if type(value) in (int, float):
        try:
            return float(value)
        except OverflowError:
            return float("inf") if value > 0 else float("-inf")  # beyond float64: as `invalid` says
    return _BAD


def _as_text(value: Any, separator: str) -> str | None:
    """Text for a JSON string, integer or list of them (joined with `separator`); None otherwise."""
    if type(value) is str:
        return value
    if type(value) is int:
        return str(value)
    if isinstance(value, list) and all(type(item) in (str, int) for item in value):
        return separator.join(str(item) for item in value)
    return None
