"""Exported table contents as plain arrays: a full ``TableState`` and an incremental ``TableDelta``.

Both are dataclasses of NumPy arrays plus a small JSON-able ``config`` dict. ``to_arrays`` flattens
them into ``dict[str, np.ndarray]`` (the config becomes a 0-d unicode array holding JSON, optimizer
state arrays become ``optimizer_state/<name>``), so a checkpoint can ``np.savez`` them and load them
back with ``allow_pickle=False``; ``from_arrays`` is the inverse.

Row ``i`` of every per-row array belongs to ``ids[i]``. ``rows`` holds the payload as stored: float32,
float16, or uint8 codes for int8 precision with ``value = code * row_scale + row_offset``
(``row_scale``/``row_offset`` are ``None`` for other precisions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Self

import numpy as np

# The stored dtype of a row's payload at each row precision.
PAYLOAD_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.uint8}

CONFIG_KEY = "config"
OPTIMIZER_PREFIX = "optimizer_state/"


def _to_arrays(record: Any) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {CONFIG_KEY: np.array(json.dumps(record.config, sort_keys=True))}
    for item in fields(record):
        value = getattr(record, item.name)
        if item.name == CONFIG_KEY or value is None:
            continue
        if item.name == "optimizer_state":
            for name, array in value.items():
                arrays[OPTIMIZER_PREFIX + name] = array
        else:
            arrays[item.name] = value
    return arrays


def _from_arrays(cls: Any, arrays: dict[str, np.ndarray]) -> Any:
    if CONFIG_KEY not in arrays:
        raise ValueError(f"{cls.__name__}.from_arrays: missing {CONFIG_KEY!r} entry")
    values: dict[str, Any] = {CONFIG_KEY: json.loads(str(np.asarray(arrays[CONFIG_KEY])[()]))}
    values["optimizer_state"] = {
        key[len(OPTIMIZER_PREFIX) :]: np.asarray(array)
        for key, array in arrays.items()
        if key.startswith(OPTIMIZER_PREFIX)
    }
    names = {item.name for item in fields(cls)} - {CONFIG_KEY, "optimizer_state"}
    for name in names:
        if name in arrays:
            values[name] = np.asarray(arrays[name])
    unknown = set(arrays) - names - {CONFIG_KEY} - {key for key in arrays if key.startswith(OPTIMIZER_PREFIX)}
    if unknown:
        raise ValueError(f"{cls.__name__}.from_arrays: unknown entries {sorted(unknown)}")
    return cls(**values)


@dataclass
class TableState:
    """Everything needed to rebuild a table: its config and all live rows."""

    config: dict[str, Any]
    ids: np.ndarray  # (n,) int64
    rows: np.ndarray  # (n, dim) float32 | float16 | uint8
    counts: np.ndarray  # (n,) uint32, gradient occurrences (saturating)
    last_step: np.ndarray  # (n,) uint32, table clock at the last update
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)  # each (n,) or (n, dim)
    row_scale: np.ndarray | None = None  # (n,) float32, int8 only
    row_offset: np.ndarray | None = None  # (n,) float32, int8 only
    admission_sketch: np.ndarray | None = None  # (depth, width) uint32, min_count admission only

    def to_arrays(self) -> dict[str, np.ndarray]:
        return _to_arrays(self)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Self:
        return _from_arrays(cls, arrays)


@dataclass
class TableDelta:
    """Rows inserted or updated since a marker (full contents) and ids removed since it.

    Applying a delta removes ``removed_ids`` first, then writes the rows, so an id removed and
    re-inserted after the marker ends up present. ``config`` carries the table config (its clock and
    admission pull counter included) plus the ``since`` and ``until`` markers; the admission state
    is carried whole, so a table restored from a full state and its deltas admits ids exactly as the
    table that exported them.
    """

    config: dict[str, Any]
    ids: np.ndarray
    rows: np.ndarray
    counts: np.ndarray
    last_step: np.ndarray
    removed_ids: np.ndarray  # (m,) int64
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)
    row_scale: np.ndarray | None = None
    row_offset: np.ndarray | None = None
    admission_sketch: np.ndarray | None = None  # the whole sketch at ``until``, min_count admission only

    def to_arrays(self) -> dict[str, np.ndarray]:
        return _to_arrays(self)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Self:
        return _from_arrays(cls, arrays)


def layout_problem(
    record: TableState | TableDelta, *, dim: int, precision: str, optimizer: str
) -> str | None:
    """What in `record`'s per-row arrays does not fit a table of `dim`, `precision` and `optimizer`
    (a field's dtype or shape, the optimizer state's fields), or None."""
    from psrec.embedding.optimizers import STATE_LAYOUT

    count = record.ids.shape[0]
    expected: list[tuple[str, Any, tuple[int, ...], Any]] = [
        ("rows", record.rows, (count, dim), PAYLOAD_DTYPES[precision]),
        ("counts", record.counts, (count,), np.uint32),
        ("last_step", record.last_step, (count,), np.uint32),
    ]
    if precision == "int8":
        expected += [
            ("row_scale", record.row_scale, (count,), np.float32),
            ("row_offset", record.row_offset, (count,), np.float32),
        ]
    layout = STATE_LAYOUT[optimizer]
    if set(record.optimizer_state) != {name for name, _, _ in layout}:
        return f"optimizer state {sorted(record.optimizer_state)} does not match"
    for name, kind, state_dtype in layout:
        shape: tuple[int, ...] = (count, dim) if kind == "element" else (count,)
        expected.append((f"optimizer_state/{name}", record.optimizer_state[name], shape, state_dtype))
    for label, array, shape, array_dtype in expected:
        if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != array_dtype:
            found = (array.shape, array.dtype) if isinstance(array, np.ndarray) else type(array).__name__
            return f"{label} must be {np.dtype(array_dtype)} of shape {shape}, got {found}"
    return None
