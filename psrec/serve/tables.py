"""Serving tables: an embedding table's rows at a serving precision, without optimizer state.

A `ServingTable` is what `psrec export` writes for each table and what a serving replica looks
rows up in: the ids sorted ascending (the id -> row index is the position found by binary search,
8 bytes per row and nothing else) and the rows in a `psrec.embedding.precision.RowStorage` at fp32,
fp16 or int8 (uint8 codes with a per-row scale and offset), rounded to nearest.

An id the table does not hold reads as the training table reads it when it evaluates: its initial
row, a pure function of (table seed, id) (`psrec.embedding.initializers`), rounded to the training
table's precision. So served scores equal the trainer's evaluation scores, new ids included.

Tables never change in place: `apply_delta` returns a new table (removed ids dropped, then the
delta's rows written whole), so a reader holding the old one keeps seeing one consistent version.

    table = ServingTable.from_state(state, precision="int8")   # a TableState of a checkpoint
    rows = table.lookup(np.array([7, 11], np.int64))           # (2, dim) float32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psrec.embedding.initializers import initial_rows
from psrec.embedding.precision import RowStorage
from psrec.embedding.specs import InitializerSpec
from psrec.embedding.state import PAYLOAD_DTYPES, TableDelta, TableState

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass(frozen=True)
class TableSource:
    """What the training table was: how it reads an id it does not hold (`ServingTable.lookup`)."""

    dim: int
    seed: int
    initializer: dict[str, Any]
    precision: str  # the training table's row precision

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TableSource:
        """From an exported table's ``config`` (`psrec.embedding.EmbeddingTable.config`)."""
        return cls(
            dim=int(config["dim"]),
            seed=int(config["seed"]),
            initializer=dict(config["initializer"]),
            precision=str(config["precision"]),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "seed": self.seed,
            "initializer": self.initializer,
            "precision": self.precision,
        }


def decode_rows(record: TableState | TableDelta, precision: str, dim: int) -> np.ndarray:
    """(n, dim) float32 values of a state's or delta's rows, stored at the training ``precision``."""
    count = record.ids.shape[0]
    storage = RowStorage(precision, dim, stochastic_rounding=False, seed=0)
    storage.grow(count)
    storage.assign(np.arange(count), record.rows, record.row_scale, record.row_offset)
    return storage.gather(np.arange(count, dtype=np.int64))


def _encode(values: np.ndarray, ids: np.ndarray, precision: str) -> RowStorage:
    storage = RowStorage(precision, values.shape[1], stochastic_rounding=False, seed=0)
    storage.grow(values.shape[0])
    storage.write(np.arange(values.shape[0], dtype=np.int64), values, ids, 0, stochastic=False)
    return storage


class ServingTable:
    """Sorted ids and their rows at one precision (see the module docstring)."""

    def __init__(
        self, name: str, *, ids: np.ndarray, storage: RowStorage, source: TableSource, precision: str
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"table {name!r}: precision must be one of {PRECISIONS}, got {precision!r}")
        if ids.ndim != 1 or ids.dtype != np.int64:
            raise ValueError(f"table {name!r}: ids must be 1-D int64, got {ids.dtype} {ids.shape}")
        if ids.size > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"table {name!r}: ids must be sorted and unique")
        if storage.values.shape[0] < ids.size or storage.dim != source.dim:
            raise ValueError(f"table {name!r}: {ids.size} ids but rows of shape {storage.values.shape}")
        self.name = name
        self.ids = ids
        self.storage = storage
        self.source = source
        self.precision = precision
        self._spec = InitializerSpec.from_dict(source.initializer)

    @property
    def dim(self) -> int:
        return self.source.dim

    @property
    def num_rows(self) -> int:
        return int(self.ids.size)

    def nbytes(self) -> int:
        """Bytes the table holds: ids + row payload (+ int8 scales and offsets)."""
        return int(self.ids.nbytes) + self.storage.nbytes()

    @classmethod
    def from_values(
        cls, name: str, ids: np.ndarray, values: np.ndarray, *, source: TableSource, precision: str
    ) -> ServingTable:
        """A table of float32 ``values`` (n, dim) for ``ids`` (any order, unique), encoded at ``precision``."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ids, values = ids[order], np.ascontiguousarray(values[order], dtype=np.float32)
        return cls(name, ids=ids, storage=_encode(values, ids, precision), source=source, precision=precision)

    @classmethod
    def from_state(cls, name: str, state: TableState, *, precision: str) -> ServingTable:
        """The table a checkpoint's full `TableState` describes, at serving ``precision``."""
        source = TableSource.from_config(state.config)
        values = decode_rows(state, source.precision, source.dim)
        return cls.from_values(name, state.ids, values, source=source, precision=precision)

    def values(self) -> np.ndarray:
        """(num_rows, dim) float32 values of every row, in id order."""
        return self.storage.gather(np.arange(self.num_rows, dtype=np.int64))

    def apply_delta(self, delta: TableDelta) -> ServingTable:
        """A new table: this one with ``delta.removed_ids`` dropped, then ``delta``'s rows written whole."""
        source = TableSource.from_config(delta.config)
        if source.dim != self.dim or source.seed != self.source.seed:
            raise ValueError(
                f"table {self.name!r}: the delta is of a table with dim {source.dim} and seed {source.seed}, "
                f"this one has dim {self.dim} and seed {self.source.seed}"
            )
        keep = ~np.isin(self.ids, delta.removed_ids) & ~np.isin(self.ids, delta.ids)
        new_values = decode_rows(delta, source.precision, source.dim)
        ids = np.concatenate([self.ids[keep], np.asarray(delta.ids, np.int64)])
        return self._merged(ids, np.flatnonzero(keep), new_values)

    def _merged(self, ids: np.ndarray, kept_rows: np.ndarray, new_values: np.ndarray) -> ServingTable:
        """Kept rows copied as stored (no second rounding), new rows encoded, all sorted by id."""
        order = np.argsort(ids, kind="stable")
        old = self.storage.export(kept_rows)
        new = _encode(new_values, ids[kept_rows.size :], self.precision).export(
            np.arange(new_values.shape[0], dtype=np.int64)
        )
        storage = RowStorage(self.precision, self.dim, stochastic_rounding=False, seed=0)
        storage.grow(ids.size)
        payload = np.concatenate([old["rows"], new["rows"]])[order]
        scales = offsets = None
        if self.precision == "int8":
            scales = np.concatenate([old["row_scale"], new["row_scale"]])[order]
            offsets = np.concatenate([old["row_offset"], new["row_offset"]])[order]
        storage.assign(np.arange(ids.size, dtype=np.int64), payload, scales, offsets)
        return ServingTable(
            self.name, ids=ids[order], storage=storage, source=self.source, precision=self.precision
        )

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Row index of each id, -1 where the table does not hold it."""
        if self.ids.size == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        found = np.searchsorted(self.ids, ids)
        found = np.minimum(found, self.ids.size - 1)
        return np.where(self.ids[found] == ids, found, -1)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), dim) float32 rows; an id not held reads as its initial row (module docstring)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows = self.positions(ids)
        present = rows >= 0
        if present.all():
            return self.storage.gather(rows)
        out = np.empty((ids.size, self.dim), dtype=np.float32)
        out[present] = self.storage.gather(rows[present])
        missing = ids[~present]
        initial = initial_rows(missing, self.dim, self._spec, self.source.seed)
        rounding = RowStorage(self.source.precision, self.dim, stochastic_rounding=False, seed=0)
        out[~present] = rounding.round_trip(initial, missing)
        return out

    # -- files -----------------------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """``{"ids", "rows"(, "row_scale", "row_offset")}`` as stored."""
        payload = self.storage.export(np.arange(self.num_rows, dtype=np.int64))
        arrays = {"ids": self.ids, **{key: value for key, value in payload.items() if value is not None}}
        return arrays

    @classmethod
    def from_arrays(
        cls, name: str, arrays: dict[str, np.ndarray], *, source: TableSource, precision: str
    ) -> ServingTable:
        """The inverse of `to_arrays`; raises ValueError naming the table and the array that is wrong."""
        expected = {"ids", "rows"} | ({"row_scale", "row_offset"} if precision == "int8" else set())
        if set(arrays) != expected:
            raise ValueError(f"table {name!r}: arrays {sorted(arrays)}, expected {sorted(expected)}")
        ids, rows = arrays["ids"], arrays["rows"]
        count = ids.shape[0]
        if rows.dtype != PAYLOAD_DTYPES[precision] or rows.shape != (count, source.dim):
            raise ValueError(
                f"table {name!r}: rows must be {np.dtype(PAYLOAD_DTYPES[precision])} of shape "
                f"{(count, source.dim)}, got {rows.dtype} {rows.shape}"
            )
        storage = RowStorage(precision, source.dim, stochastic_rounding=False, seed=0)
        storage.grow(count)
        storage.assign(
            np.arange(count, dtype=np.int64), rows, arrays.get("row_scale"), arrays.get("row_offset")
        )
        return cls(name, ids=np.asarray(ids, np.int64), storage=storage, source=source, precision=precision)
