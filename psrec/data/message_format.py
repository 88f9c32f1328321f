"""Stream messages -> the raw table a file reader makes of the same rows: one message is one row.

A message is a JSON object with the schema's column names, one CSV/TSV line with the columns in a
given order (by default the schema's: labels, dense, sparse, sequences), or one Avro record of a
given record schema. All decode to the columns and Arrow types the text readers parse files to
(`features.text_column_types`: labels and dense float64, hashed sparse as text, pass-through ids
int64, missing = null), so that `features.prepare_table` and `features.table_to_batch` make the same
`Batch` of a row whether it came from a file or a stream. Lines parse with the text readers' own
`text_format.parse_lines`.

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

Avro: each message is one record of the source's record schema (`AvroMessages`), read with
fastavro's `schemaless_reader`, either bare (`framing: plain`, as `schemaless_writer` writes it) or
in the Confluent wire format (`framing: confluent`, what Confluent's serializers and schema-registry
tools write: byte 0, a 4-byte big-endian schema id, then the record). The id is not looked up in a
registry: the given schema reads every message (with `schema_id` set, a message of another id is a
bad row). The framing is a setting, never guessed: a bare record often starts with byte 0 too. The
record's fields map to columns by name and convert as JSON values do (null as JSON null, arrays as
JSON lists); which Avro types a column takes is checked when the decoder is made
(`check_avro_columns`: labels and dense: int, long, float, double; pass-through ids: int, long;
hashed sparse and sequences: string, int, long, enum or an array of them; each optionally in a
union with null; no logical types), so a schema that cannot fill the columns fails before any
message is read. A message that does not decode as one record (truncated, corrupt, bytes left over,
not framed as set) is a bad row.

    avro = AvroMessages(load_avro_schema("clicks.avsc"), framing="confluent")
    decoder = MessageDecoder(schema, "avro", BadRows("raise"), avro=avro)
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from psrec.data.errors import BadRows, Policy
from psrec.data.features import ROW_ID, bad_rows, text_column_types
from psrec.data.schema import (
    AvroFraming,
    MessageFormat,
    Schema,
    SequenceFeature,
    SparseFeature,
)
from psrec.data.text_format import parse_failure, parse_lines

INT64_MAX = (1 << 63) - 1
Locate = Callable[[int], tuple[str, str]]  # message index -> (source, location), as BadRows reports them
RESOLVE = "set on_error: skip to count bad messages and go on"
CONFLUENT_MAGIC = 0  # the Confluent wire format's first byte
CONFLUENT_HEADER = 5  # magic byte + 4-byte big-endian schema id
SAMPLE_BYTES = 64  # bytes of a bad binary message shown (as hex) in its report
# What fastavro raises on bytes that are not a record of the schema (UnicodeDecodeError is a ValueError).
AVRO_ERRORS = (EOFError, IndexError, ValueError, OverflowError, MemoryError)
AVRO_NUMBERS = {"int", "long", "float", "double"}
AVRO_INTEGERS = {"int", "long"}
AVRO_TEXT_ITEMS = {"string", "int", "long", "enum"}


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class AvroMessages:
    """How Avro messages are written: `schema` the record schema (Avro's JSON form, e.g. from
    `load_avro_schema`), `framing` "plain" (the bare record) or "confluent" (magic byte 0 and a
    4-byte schema id before it), `schema_id` the only Confluent schema id accepted (None: any)."""

    schema: Mapping[str, Any]
    framing: AvroFraming = "confluent"
    schema_id: int | None = None


def _named_types(avro_type: Any, named: dict[str, Any]) -> dict[str, Any]:
    """Every named type (record, enum, fixed) defined in `avro_type`, by name and by full name."""
    if isinstance(avro_type, list):
        for branch in avro_type:
            _named_types(branch, named)
    elif isinstance(avro_type, dict):
        if "name" in avro_type and avro_type.get("type") in ("record", "enum", "fixed"):
            named[avro_type["name"]] = avro_type
            if avro_type.get("namespace"):
                named[f"{avro_type['namespace']}.{avro_type['name']}"] = avro_type
        for field in avro_type.get("fields", []):
            _named_types(field.get("type"), named)
        for key in ("items", "values"):
            if key in avro_type:
                _named_types(avro_type[key], named)
    return named


def _avro_branches(avro_type: Any, named: dict[str, Any]) -> list[Any]:
    """The types a value may have: a union's branches, named types resolved."""
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    return [named.get(branch, branch) if isinstance(branch, str) else branch for branch in branches]


def _avro_name(branch: Any) -> str:
    """A type's name as an error shows it and the checks compare it: "long", "array", "long/uuid"."""
    if isinstance(branch, str):
        return branch
    if isinstance(branch, dict):
        logical = branch.get("logicalType")
        name = _avro_name(branch.get("type"))
        return f"{name}/{logical}" if logical else name
    return repr(branch)


def _avro_field_types(avro_schema: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each field's type names (a union's branches; "array of string | long" for an array)."""
    named = _named_types(dict(avro_schema), {})
    types = {}
    for field in avro_schema["fields"]:
        names = []
        for branch in _avro_branches(field["type"], named):
            name = _avro_name(branch)
            if name == "array":
                items = [_avro_name(item) for item in _avro_branches(branch["items"], named)]
                name = f"array of {' | '.join(items)}"
            names.append(name)
        types[field["name"]] = names
    return types


def check_avro_columns(schema: Schema, avro_schema: Mapping[str, Any]) -> None:
    """Raise ValueError unless the record schema has a field of a fitting type for each of `schema`'s
    columns (see the module docstring); fields no column names may be of any type."""
    fields = _avro_field_types(avro_schema)
    types = text_column_types(schema)
    missing = [name for name in types if name not in fields]
    if missing:
        raise ValueError(f"the Avro schema {avro_schema.get('name')!r} has no fields {missing}")
    for name, kind in types.items():
        if kind == pa.float64():
            allowed, wanted = AVRO_NUMBERS, "int, long, float or double"
        elif kind == pa.int64():
            allowed, wanted = AVRO_INTEGERS, "int or long"
        else:
            allowed, wanted = AVRO_TEXT_ITEMS, "string, int, long, enum or an array of them"
        for found in fields[name]:
            items = found.removeprefix("array of ").split(" | ") if found.startswith("array of ") else None
            fits = found == "null" or found in allowed
            if items is not None and kind == pa.string():
                fits = all(item in AVRO_TEXT_ITEMS for item in items)
            if not fits:
                raise ValueError(
                    f"Avro field {name!r} is of type {found}: its column needs {wanted} (or a union of "
                    "them with null; no logical types)"
                )


def _avro_direct_columns(schema: Schema, avro_schema: Mapping[str, Any]) -> list[str]:
    """The columns whose Avro values Arrow converts to the column's type as they are (numbers, ids,
    strings and enum symbols); the others (integers or arrays for text) convert as JSON values do."""
    fields = _avro_field_types(avro_schema)
    return [
        name
        for name, kind in text_column_types(schema).items()
        if kind != pa.string() or set(fields[name]) <= {"string", "enum", "null"}
    ]


class MessageDecoder:
    """Decodes blocks of messages of one format for `schema` (see the module docstring).

    `columns`: the column order of CSV/TSV lines (default: the schema's); `delimiter`: default ","
    for csv and tab for tsv. Only csv lines may quote values (`"`), as in files. `avro`: how Avro
    messages are written (required for, and only for, "avro").
    """

    def __init__(
        self,
        schema: Schema,
        message_format: MessageFormat,
        errors: BadRows,
        *,
        columns: Sequence[str] | None = None,
        delimiter: str | None = None,
        avro: AvroMessages | None = None,
    ) -> None:
        if (message_format == "avro") != (avro is not None):
            raise ValueError("Avro messages need `avro` (their schema), and only they take it")
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
        self.avro = avro
        self.avro_schema: Any = None  # fastavro's parsed form of avro.schema
        self.direct: list[str] = []  # columns Arrow converts from the records at once (Avro only)
        if avro is not None:
            import fastavro  # here, not at the top: only Avro sources pay for its import

            check_avro_columns(schema, avro.schema)
            self.avro_schema = fastavro.parse_schema(dict(avro.schema))
            self.direct = _avro_direct_columns(schema, avro.schema)

    def decode(
        self, values: Sequence[bytes | None], row_ids: np.ndarray, locate: Locate
    ) -> tuple[pa.Table | None, np.ndarray]:
        """(table of the good messages' rows with `__row_id`, index of each row's message in `values`).

        `row_ids`: (len(values),) int64, the row id each message gets; `locate(i)` names message i
        for a bad-row report. No table when no message of the block is good.
        """
        problems: dict[int, tuple[str, Policy | None]] = {}  # message -> (reason, policy override)
        if self.message_format == "json":
            table, kept = self._records(*self._json(values, problems), problems)
        elif self.message_format == "avro":
            table, kept = self._records(*self._avro(values, problems), problems)
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
        if self.message_format == "avro" and value is not None:
            sample = value[:SAMPLE_BYTES].hex() + ("..." if len(value) > SAMPLE_BYTES else "")
        else:
            sample = _text(value)
        self.errors.report(source, location, reason, sample, policy=policy)

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

    # -- JSON objects and Avro records ---------------------------------------------------------

    def _json(
        self, values: Sequence[bytes | None], problems: dict[int, tuple[str, Policy | None]]
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """(the objects of the messages that are JSON objects, the index of each one's message)."""
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
        return rows, indices

    def _avro(
        self, values: Sequence[bytes | None], problems: dict[int, tuple[str, Policy | None]]
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """(the records of the messages that decode as one record, the index of each one's message)."""
        from fastavro import schemaless_reader

        assert self.avro is not None
        framed = self.avro.framing == "confluent"
        wanted_id = self.avro.schema_id
        rows: list[dict[str, Any]] = []
        indices: list[int] = []
        for index, value in enumerate(values):
            value = value or b""
            start = 0
            if framed:
                if len(value) < CONFLUENT_HEADER or value[0] != CONFLUENT_MAGIC:
                    problems[index] = (_unframed(value), None)
                    continue
                schema_id = int.from_bytes(value[1:CONFLUENT_HEADER], "big")
                if wanted_id is not None and schema_id != wanted_id:
                    problems[index] = (
                        f"written with schema id {schema_id}, not the source's avro_schema_id {wanted_id}",
                        None,
                    )
                    continue
                start = CONFLUENT_HEADER
            stream = io.BytesIO(value)
            stream.seek(start)
            try:
                row = schemaless_reader(stream, self.avro_schema)
            except AVRO_ERRORS as error:
                problems[index] = (f"not an Avro record of the schema: {type(error).__name__}: {error}", None)
                continue
            left = len(value) - stream.tell()
            if left:
                problems[index] = (
                    f"{left} byte(s) after the Avro record (written with another schema, or not one record)",
                    None,
                )
                continue
            assert isinstance(row, dict)  # the schema's type is "record"
            rows.append(row)
            indices.append(index)
        return rows, indices

    def _records(
        self, rows: list[dict[str, Any]], indices: list[int], problems: dict[int, tuple[str, Policy | None]]
    ) -> tuple[pa.Table | None, np.ndarray]:
        """The table of the objects' columns, and the index of each row's message; an object with a
        value of the wrong kind is a bad row. The `direct` columns convert in one Arrow call."""
        wrong: dict[int, str] = {}  # row -> reason
        converted: dict[str, pa.Array] = {}
        if self.direct:
            try:
                records = pa.array(rows, pa.struct([(name, self.types[name]) for name in self.direct]))
                converted = {name: records.field(name) for name in self.direct}
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                pass  # a value out of range: column by column, naming it
        arrays = {
            name: converted[name] if name in converted else self._json_column(name, kind, rows, wrong)
            for name, kind in self.types.items()
        }
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


def _unframed(value: bytes) -> str:
    """Why `value` is not in the Confluent wire format."""
    if not value:
        return "an empty message (an Avro record in the Confluent wire format expected)"
    if value[0] != CONFLUENT_MAGIC:
        return (
            f"first byte 0x{value[0]:02x} is not the Confluent wire format's magic byte 0 (set "
            "avro_framing: plain for bare Avro records)"
        )
    return f"{len(value)} byte(s): shorter than the Confluent wire format's 5-byte header"


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
