"""Serving requests: validate raw feature rows from JSON and turn them into a `Batch`, as training reads them.

A request body is a JSON object::

    {"rows": [{"user": 12, "item": 7, "daytime": 3, ...}, ...]}          CTR models (and BST)
    {"rows": [{"seq": [12, 40, 7], "candidates": [5, 9, 31]}], "k": 2}   SASRec, HSTU (candidates optional)
    {"rows": [{"user": 17, "history": [3, 9]}], "k": 10, "catalogue": true}   BST over every item

Every row names every feature the model reads, with the value as it appears in the training data:
a dense feature a number (null = missing, filled as training fills it); a hashed sparse feature
text or an integer (an integer hashes as its decimal text, null as the empty string); a
pass-through one (``hashed: false``) an integer in [0, 2**48); a multi-valued feature or a
sequence a list of such values or one ``separator``-joined text. The values then go through the
training code's own hashing and dense transforms (`psrec.data.features.prepare_table`), so a row
is featurized exactly as the trainer featurized it.

Anything else is a `RequestError`: an HTTP status (400, or 413 for too many rows) and a message
that names the field (``rows[3].weekday``) and says what was expected.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from psrec.data.batch import Batch
from psrec.data.feature_hashing import MAX_PASSTHROUGH_ID, hash_values
from psrec.data.features import ROW_ID, prepare_table, table_to_batch
from psrec.data.schema import Schema, SequenceFeature, SparseFeature
from psrec.serve.model_dir import NEXT_ITEM

DEFAULT_MAX_ROWS = 4096
DEFAULT_K = 10
MAX_K = 1000
CANDIDATES = "candidates"


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx) and a message naming the field."""

    def __init__(self, field: str, message: str, *, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": str(self), "field": self.field}


@dataclass(frozen=True)
class RequestSpec:
    """What rows of one model carry: its serving schema, and whether/what candidates it ranks."""

    schema: Schema  # the features the model reads (labels are not part of a request)
    kind: str  # "ctr", "bst" or "next_item"
    candidate_feature: SparseFeature | SequenceFeature | None  # how candidate values become ids
    max_rows: int = DEFAULT_MAX_ROWS

    @property
    def feature_names(self) -> list[str]:
        return self.schema.feature_names

    @property
    def ranks(self) -> bool:
        return self.candidate_feature is not None


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its rows as a `Batch`, candidate ids per row (ranking) and ``k``."""

    batch: Batch
    candidates: list[np.ndarray] | None  # per row: candidate ids (hashed as the items were)
    candidate_values: list[list[Any]] | None  # per row: the candidates as given
    k: int
    # BST with candidates: the batch holds each row once per candidate (the target feature set to
    # it), row after row; `groups` is the number of candidates of each row
    groups: list[int] | None = None
    # BST ranking every item of the target feature's table (`"catalogue": true`): the batch holds
    # each row once, its target feature left empty
    catalogue: bool = False


def serving_schema(schema: Schema, kind: str, *, sequence_name: str | None = None) -> Schema:
    """The part of the training schema a request carries: next-item models read "seq", BST its history."""
    if kind == NEXT_ITEM:
        sequences = [f for f in schema.sequences if f.name == "seq"]
        return Schema(label=schema.label, sequences=sequences)
    if kind == "bst":
        sequences = [f for f in schema.sequences if f.name == sequence_name]
        return Schema(label=schema.label, dense=schema.dense, sparse=schema.sparse, sequences=sequences)
    return Schema(label=schema.label, dense=schema.dense, sparse=schema.sparse)


def decode_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError("body", f"not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise RequestError("body", f'must be a JSON object {{"rows": [...]}}, got {type(body).__name__}')
    return body


def parse_request(body: dict[str, Any], spec: RequestSpec) -> ParsedRequest:
    """Validate ``body`` (see the module docstring) and featurize its rows."""
    allowed = {"rows", "k"} | ({"catalogue"} if spec.kind == "bst" else set())
    for key in body:
        if key not in allowed:
            raise RequestError(key, f"unknown request field; a request has {sorted(allowed)}")
    if "rows" not in body:
        raise RequestError("rows", 'missing: a request is {"rows": [{feature: value, ...}, ...]}')
    rows = body["rows"]
    if not isinstance(rows, list):
        raise RequestError("rows", f"must be a list of row objects, got {type(rows).__name__}")
    if not rows:
        raise RequestError("rows", "is empty: give at least one row")
    if len(rows) > spec.max_rows:
        raise RequestError(
            "rows", f"{len(rows)} rows; at most {spec.max_rows} per request: split the batch", status=413
        )
    k = body.get("k", DEFAULT_K)
    if not spec.ranks and "k" in body:
        raise RequestError("k", f"applies to ranking models only; this {spec.kind} model returns scores")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise RequestError("k", f"must be an integer in [1, {MAX_K}], got {k!r}")
    catalogue = body.get("catalogue", False)
    if not isinstance(catalogue, bool):
        raise RequestError("catalogue", f"must be true or false, got {catalogue!r}")
    if catalogue:
        return _catalogue_request(rows, spec, k)
    known = set(spec.feature_names) | ({CANDIDATES} if spec.ranks else set())
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RequestError(
                f"rows[{index}]", f"must be an object of feature values, got {type(row).__name__}"
            )
        for key in row:
            if key not in known:
                raise RequestError(
                    f"rows[{index}].{key}", f"unknown feature; this model reads {sorted(spec.feature_names)}"
                )
        for name in spec.feature_names:
            if name not in row and not (spec.kind == "bst" and name == _target(spec) and CANDIDATES in row):
                raise RequestError(f"rows[{index}].{name}", "missing (null stands for a missing value)")
    groups = None
    if spec.kind == "bst":
        candidates, values = _candidates(rows, spec)
        if candidates is not None and values is not None:
            target = _target(spec)
            # every row once as given (the first candidate as its target), so errors name its index
            _columns(
                [{**row, target: value[0]} for row, value in zip(rows, values, strict=True)], spec.schema
            )
            rows = [
                {**{k: v for k, v in row.items() if k != CANDIDATES}, target: item}
                for row, value in zip(rows, values, strict=True)
                for item in value
            ]
            if len(rows) > spec.max_rows:
                raise RequestError(
                    "rows", f"{len(rows)} rows with their candidates; at most {spec.max_rows}", status=413
                )
            groups = [len(value) for value in values]
        else:
            rows = [{k: v for k, v in row.items() if k != CANDIDATES} for row in rows]
    columns = _columns(rows, spec.schema)
    table = pa.table(
        {
            **columns,
            **{name: pa.array(np.zeros(len(rows), np.float32)) for name in spec.schema.label_names},
            ROW_ID: pa.array(np.arange(len(rows), dtype=np.int64)),
        }
    )
    batch = table_to_batch(spec.schema, prepare_table(spec.schema, table))
    if spec.kind == NEXT_ITEM:  # the model reads the last position of the history: it needs one
        for name, padded in batch.sequences.items():
            empty = np.flatnonzero(~padded.mask.any(axis=1))
            if empty.size:
                raise RequestError(f"rows[{int(empty[0])}].{name}", "is empty: give at least one item")
    if spec.kind == "bst":
        return ParsedRequest(
            batch=batch, candidates=None, candidate_values=values if groups else None, k=k, groups=groups
        )
    candidates, values = _candidates(rows, spec)
    return ParsedRequest(batch=batch, candidates=candidates, candidate_values=values, k=k)


def _catalogue_request(rows: list[Any], spec: RequestSpec, k: int) -> ParsedRequest:
    """BST rows to rank against every item of the target table: the target feature is not given."""
    target = _target(spec)
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RequestError(
                f"rows[{index}]", f"must be an object of feature values, got {type(row).__name__}"
            )
        for key in row:
            if key in (target, CANDIDATES):
                raise RequestError(
                    f"rows[{index}].{key}", f"not with catalogue: every {target} of the catalogue is ranked"
                )
            if key not in spec.feature_names:
                raise RequestError(
                    f"rows[{index}].{key}", f"unknown feature; this model reads {sorted(spec.feature_names)}"
                )
        for name in spec.feature_names:
            if name != target and name not in row:
                raise RequestError(f"rows[{index}].{name}", "missing (null stands for a missing value)")
    assert spec.candidate_feature is not None
    placeholder = None if spec.candidate_feature.hashed else 0  # replaced by each catalogue item
    rows = [{**row, target: placeholder} for row in rows]
    columns = _columns(rows, spec.schema)
    table = pa.table(
        {
            **columns,
            **{name: pa.array(np.zeros(len(rows), np.float32)) for name in spec.schema.label_names},
            ROW_ID: pa.array(np.arange(len(rows), dtype=np.int64)),
        }
    )
    batch = table_to_batch(spec.schema, prepare_table(spec.schema, table))
    return ParsedRequest(batch=batch, candidates=None, candidate_values=None, k=k, catalogue=True)


def _target(spec: RequestSpec) -> str:
    assert spec.candidate_feature is not None
    return spec.candidate_feature.name


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _id_value(value: Any, feature: SparseFeature | SequenceFeature, field: str) -> Any:
    """One sparse value as the Arrow column takes it: text for hashed features, int for pass-through."""
    if feature.hashed:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # integers hash as their decimal text
        raise RequestError(field, f"must be text or an integer, got {type(value).__name__} {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer id (pass-through feature), got {type(value).__name__}")
    if not 0 <= value < MAX_PASSTHROUGH_ID:
        raise RequestError(field, f"id {value} outside [0, 2**48)")
    return value


def _list_value(value: Any, feature: SparseFeature | SequenceFeature, field: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        tokens = [token for token in value.split(feature.separator) if token]
        if feature.hashed:
            return tokens
        try:
            return [_id_value(int(token), feature, field) for token in tokens]
        except ValueError:
            raise RequestError(field, f"must hold integer ids, got {value!r}") from None
    if not isinstance(value, list):
        raise RequestError(
            field, f"must be a list or {feature.separator!r}-joined text, got {type(value).__name__}"
        )
    return [_id_value(item, feature, f"{field}[{i}]") for i, item in enumerate(value)]


def _columns(rows: list[dict[str, Any]], schema: Schema) -> dict[str, pa.Array]:
    columns: dict[str, pa.Array] = {}
    for dense in schema.dense:
        values = []
        for index, row in enumerate(rows):
            value = row[dense.name]
            if value is not None and not _is_number(value):
                raise RequestError(
                    f"rows[{index}].{dense.name}", f"must be a number or null, got {type(value).__name__}"
                )
            values.append(None if value is None else float(value))
        columns[dense.name] = pa.array(values, pa.float64())
    features: list[SparseFeature | SequenceFeature] = [*schema.sparse, *schema.sequences]
    for feature in features:
        multi = isinstance(feature, SequenceFeature) or feature.multi_valued
        id_type = pa.string() if feature.hashed else pa.int64()
        if multi:
            lists = [
                _list_value(row[feature.name], feature, f"rows[{i}].{feature.name}")
                for i, row in enumerate(rows)
            ]
            columns[feature.name] = pa.array(lists, pa.list_(id_type))
            continue
        single = []
        for index, row in enumerate(rows):
            value = row[feature.name]
            field = f"rows[{index}].{feature.name}"
            if value is None and not feature.hashed:
                raise RequestError(field, "missing id: a pass-through feature needs an integer")
            single.append(None if value is None else _id_value(value, feature, field))
        columns[feature.name] = pa.array(single, id_type)
    return columns


def _candidates(
    rows: list[dict[str, Any]], spec: RequestSpec
) -> tuple[list[np.ndarray] | None, list[list[Any]] | None]:
    """Per-row candidate ids when the rows give candidates (all or none of them), else None (catalogue)."""
    feature = spec.candidate_feature
    if feature is None:
        return None, None
    given = [CANDIDATES in row for row in rows]
    if not any(given):
        return None, None
    if not all(given):
        index = given.index(False)
        raise RequestError(
            f"rows[{index}].{CANDIDATES}", "missing: give candidates for every row or for none"
        )
    ids, values = [], []
    for index, row in enumerate(rows):
        field = f"rows[{index}].{CANDIDATES}"
        items = row[CANDIDATES]
        if not isinstance(items, list) or not items:
            raise RequestError(field, "must be a non-empty list of item values")
        checked = [_id_value(item, feature, f"{field}[{i}]") for i, item in enumerate(items)]
        if feature.hashed:
            ids.append(hash_values(feature.id_namespace, checked))
        else:
            ids.append(np.asarray(checked, dtype=np.int64))
        values.append(list(items))
    return ids, values


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a non-finite score is sent as null."""
    return value if math.isfinite(value) else None
