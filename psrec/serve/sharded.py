"""Sharded lookup for large tables: lookup shards hold parts of a table, replicas route ids to them.

A table too large to copy into every serving replica is split over ``num_shards`` `TableShard`s
by the parameter server's routing (`psrec.ps.routing`: id -> one of 1024 virtual buckets ->
shard), each holding its ids and rows as a `psrec.serve.tables.ServingTable`. A replica's
`ShardedTable` looks ids up in three steps, as the trainer's client does:

1. **route**: group the ids by owning shard (`psrec.ps.routing.route`);
2. **compute**: every shard looks its ids up (all shards at once; an id a shard does not hold reads
   as its initial row, exactly as in an unsharded table);
3. **return**: the rows are put back in the order of the ids (`Routed.gather`).

`TableShard` is a plain class: `psrec serve --shard-rows N` runs each as a Ray actor
(`RayShard`), tests call it in process (`LocalShard`). Sharded tables are read-only: they serve
one export, and ``--follow`` needs every table inside the replicas.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from psrec.ps.routing import default_bucket_map, route
from psrec.serve.model_dir import read_model_dir
from psrec.serve.scoring import tables_of
from psrec.serve.tables import ServingTable, TableSource
from psrec.storage import StoragePath

NUM_BUCKETS = 1024


def bucket_map(num_shards: int) -> np.ndarray:
    return default_bucket_map(NUM_BUCKETS, num_shards)


def partition(table: ServingTable, shard: int, num_shards: int) -> ServingTable:
    """The part of ``table`` whose ids ``shard`` owns."""
    owner = route(table.ids, bucket_map(num_shards))
    own = (
        np.sort(owner.order[owner.splits[shard] : owner.splits[shard + 1]])
        if owner.order is not None
        else None
    )
    arrays = table.to_arrays()
    picked = {name: array[own] for name, array in arrays.items()} if own is not None else arrays
    return ServingTable.from_arrays(table.name, picked, source=table.source, precision=table.precision)


class TableShard:
    """One lookup shard: its part of each named table of an export."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | StoragePath,
        *,
        shard: int,
        num_shards: int,
        tables: list[str],
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards}")
        contents = read_model_dir(model_dir)
        missing = sorted(set(tables) - set(contents.tables))
        if missing:
            raise ValueError(f"{model_dir} has no table(s) {missing}; it has {sorted(contents.tables)}")
        whole = tables_of(contents)
        self.tables = {name: partition(whole[name], shard, num_shards) for name in tables}

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self.tables[table].lookup(ids)

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per table: rows and bytes held, and its source (what the replicas need to know)."""
        return {
            name: {
                "rows": t.num_rows,
                "bytes": t.nbytes(),
                "source": t.source.as_dict(),
                "precision": t.precision,
            }
            for name, t in self.tables.items()
        }


class ShardConnection(Protocol):
    """How a replica reaches one `TableShard`: start lookups on all shards, then collect them."""

    def submit(self, table: str, ids: np.ndarray) -> Any: ...

    def collect(self, handles: list[Any]) -> list[np.ndarray]: ...


class LocalShard:
    """A `TableShard` in this process."""

    def __init__(self, shard: TableShard) -> None:
        self.shard = shard

    def submit(self, table: str, ids: np.ndarray) -> Any:
        return self.shard.lookup(table, ids)

    def collect(self, handles: list[Any]) -> list[np.ndarray]:
        return list(handles)


class RayShard:
    """A `TableShard` running as a Ray actor (``ray.remote(TableShard)``)."""

    def __init__(self, actor: Any, *, timeout_seconds: float = 30.0) -> None:
        self.actor = actor
        self.timeout_seconds = timeout_seconds

    def submit(self, table: str, ids: np.ndarray) -> Any:
        return self.actor.lookup.remote(table, ids)

    def collect(self, handles: list[Any]) -> list[np.ndarray]:
        import ray

        return list(ray.get(handles, timeout=self.timeout_seconds))


class ShardedTable:
    """A table whose rows live in lookup shards; `lookup` is route -> compute -> return."""

    def __init__(
        self, name: str, shards: list[ShardConnection], *, source: TableSource, precision: str, num_rows: int
    ) -> None:
        if not shards:
            raise ValueError(f"table {name!r}: at least one lookup shard")
        self.name = name
        self.shards = shards
        self.source = source
        self.precision = precision
        self.num_rows = num_rows
        self._bucket_map = bucket_map(len(shards))

    @property
    def dim(self) -> int:
        return self.source.dim

    def nbytes(self) -> int:
        return 0  # held by the lookup shards, not by this process

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        routed = route(ids, self._bucket_map)  # route
        handles = [  # compute, on every shard at once
            shard.submit(self.name, part)
            for shard, part in zip(self.shards, routed.ids_per_shard, strict=True)
        ]
        parts = [connection.collect([h])[0] for connection, h in zip(self.shards, handles, strict=True)]
        return routed.gather(parts, out=np.empty((ids.size, self.dim), dtype=np.float32))  # return

    @property
    def ids(self) -> np.ndarray:
        raise ValueError(
            f"table {self.name!r} is served by lookup shards: ranking over the whole catalogue needs it in "
            "the replica (give candidates, or serve without --shard-rows)"
        )

    def values(self) -> np.ndarray:
        return self.ids  # raises, as `ids`


def sharded_tables(
    described: list[dict[str, dict[str, Any]]], connections: list[ShardConnection]
) -> dict[str, ShardedTable]:
    """`ShardedTable`s over ``connections`` from each shard's `TableShard.describe`."""
    out = {}
    for name, first in described[0].items():
        out[name] = ShardedTable(
            name,
            connections,
            source=TableSource(**first["source"]),
            precision=first["precision"],
            num_rows=sum(shard[name]["rows"] for shard in described),
        )
    return out
