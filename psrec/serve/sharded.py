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
(`RayShard`), tests call it in process (`LocalShard`).

Versions (``--follow``): a lookup shard holds its part of the tables of each of its last
`KEPT_VERSIONS` model versions, by label. A replica's follower asks every shard to `prepare` the
next version (its part of a delta applied to the version served, or of a whole checkpoint chain;
each shard reads the checkpoint's files itself, verified, and keeps the ids it owns), and only once
every shard has it does the replica swap to tables that name that version in each lookup: a
request reads one version from every shard, never half of a delta. Preparing a version a shard
holds already (another replica asked first) costs nothing.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from psrec.checkpoint.load import load_checkpoint
from psrec.checkpoint.manifest import read_manifest
from psrec.checkpoint.policy import CheckpointRef
from psrec.ps.reshard import arrays_for_shard
from psrec.ps.routing import bucket_of, default_bucket_map, route
from psrec.serve.export import apply_delta_files, only_tables, tables_of_chain
from psrec.serve.model_dir import read_model_dir
from psrec.serve.scoring import tables_of
from psrec.serve.tables import ServingTable, TableSource
from psrec.storage import StoragePath

NUM_BUCKETS = 1024
# Versions a lookup shard keeps: the newest, and older ones that replicas may still be reading
# (a replica swaps to a version only once every shard holds it, and requests under way finish on
# the version they started with).
KEPT_VERSIONS = 3
PREPARE_TIMEOUT_S = 600.0  # a shard reading and applying a checkpoint's files for a new version


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
        self.shard, self.num_shards, self.names = shard, num_shards, list(tables)
        self.precision: str = contents.serving["precision"]
        self.latest: str = contents.serving["version"]["label"]
        self.versions = {self.latest: {name: partition(whole[name], shard, num_shards) for name in tables}}

    @property
    def tables(self) -> dict[str, ServingTable]:
        """The newest version's tables."""
        return self.versions[self.latest]

    def lookup(self, table: str, ids: np.ndarray, version: str | None = None) -> np.ndarray:
        """Rows of `ids` in `table` of `version` (None: the newest)."""
        return self._version(version)[table].lookup(ids)

    def _version(self, label: str | None) -> dict[str, ServingTable]:
        try:
            return self.versions[self.latest if label is None else label]
        except KeyError:
            raise LookupError(
                f"lookup shard {self.shard} no longer holds version {label!r} (it keeps the last "
                f"{KEPT_VERSIONS}: {list(self.versions)})"
            ) from None

    def prepare(self, label: str, *, base: str | None, refs: list[CheckpointRef]) -> dict[str, Any]:
        """Hold version `label`: `refs` is one delta checkpoint applied to version `base`, or, with
        `base` None, a whole chain (a full checkpoint and its deltas). Returns `describe` of it."""
        if label not in self.versions:
            files = [self._owned_arrays(ref) for ref in refs]
            if base is not None:
                (delta,) = files
                tables = apply_delta_files(self._version(base), {0: delta})
            else:
                tables = tables_of_chain([{0: arrays} for arrays in files], precision=self.precision)
            if set(tables) != set(self.names):
                raise ValueError(f"{refs[-1].name} holds tables {sorted(tables)}, this shard {self.names}")
            self.versions[label] = tables
            self.latest = label
            while len(self.versions) > KEPT_VERSIONS:
                del self.versions[next(iter(self.versions))]
        return self.describe(label)

    def _owned_arrays(self, ref: CheckpointRef) -> dict[str, np.ndarray]:
        """This shard's ids of its tables in `ref`, merged over the checkpoint's shard files."""
        written = sorted(int(s) for s in read_manifest(ref)["shards"])
        data = load_checkpoint(ref, shards=written, dense=False)  # verified first
        owner = bucket_map(self.num_shards)

        def owns(ids: np.ndarray) -> np.ndarray:
            return np.asarray(owner[bucket_of(ids, NUM_BUCKETS)] == self.shard)

        return arrays_for_shard([only_tables(data.shards[s], self.names) for s in written], owns=owns)

    def describe(self, label: str | None = None) -> dict[str, dict[str, Any]]:
        """Per table of version `label` (None: the newest): rows and bytes held, its source and the
        version (what the replicas need to know)."""
        return {
            name: {
                "rows": t.num_rows,
                "bytes": t.nbytes(),
                "source": t.source.as_dict(),
                "precision": t.precision,
                "version": self.latest if label is None else label,
            }
            for name, t in self._version(label).items()
        }


class ShardConnection(Protocol):
    """How a replica reaches one `TableShard`: start lookups (or the preparation of a version) on
    all shards, then collect them."""

    def submit(self, table: str, ids: np.ndarray, version: str | None) -> Any: ...

    def submit_prepare(self, label: str, *, base: str | None, refs: list[CheckpointRef]) -> Any: ...

    def collect(self, handles: list[Any], timeout: float | None = None) -> list[Any]: ...


class LocalShard:
    """A `TableShard` in this process."""

    def __init__(self, shard: TableShard) -> None:
        self.shard = shard

    def submit(self, table: str, ids: np.ndarray, version: str | None) -> Any:
        return self.shard.lookup(table, ids, version)

    def submit_prepare(self, label: str, *, base: str | None, refs: list[CheckpointRef]) -> Any:
        return self.shard.prepare(label, base=base, refs=refs)

    def collect(self, handles: list[Any], timeout: float | None = None) -> list[Any]:
        return list(handles)


class RayShard:
    """A `TableShard` running as a Ray actor (``ray.remote(TableShard)``)."""

    def __init__(self, actor: Any, *, timeout_seconds: float = 30.0) -> None:
        self.actor = actor
        self.timeout_seconds = timeout_seconds

    def submit(self, table: str, ids: np.ndarray, version: str | None) -> Any:
        return self.actor.lookup.remote(table, ids, version)

    def submit_prepare(self, label: str, *, base: str | None, refs: list[CheckpointRef]) -> Any:
        return self.actor.prepare.remote(label, base=base, refs=refs)

    def collect(self, handles: list[Any], timeout: float | None = None) -> list[Any]:
        import ray

        return list(ray.get(handles, timeout=self.timeout_seconds if timeout is None else timeout))


class ShardedTable:
    """A table whose rows live in lookup shards; `lookup` is route -> compute -> return."""

    def __init__(
        self,
        name: str,
        shards: list[ShardConnection],
        *,
        source: TableSource,
        precision: str,
        num_rows: int,
        version: str | None = None,
    ) -> None:
        if not shards:
            raise ValueError(f"table {name!r}: at least one lookup shard")
        self.name = name
        self.shards = shards
        self.source = source
        self.precision = precision
        self.num_rows = num_rows
        self.version = version  # the model version every lookup reads (None: each shard's newest)
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
            shard.submit(self.name, part, self.version)
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
    """`ShardedTable`s over ``connections`` from each shard's `TableShard.describe` (of one version)."""
    out = {}
    for name, first in described[0].items():
        versions = {shard[name]["version"] for shard in described}
        if len(versions) != 1:
            raise ValueError(f"table {name!r}: the lookup shards hold versions {sorted(versions)}")
        out[name] = ShardedTable(
            name,
            connections,
            source=TableSource(**first["source"]),
            precision=first["precision"],
            num_rows=sum(shard[name]["rows"] for shard in described),
            version=first["version"],
        )
    return out


def prepare_version(
    tables: dict[str, ShardedTable], label: str, *, base: str | None, refs: list[CheckpointRef]
) -> dict[str, ShardedTable]:
    """Have every lookup shard of `tables` hold version `label` (`TableShard.prepare`, all shards at
    once), and return the tables that read it."""
    if not tables:
        return {}
    connections = next(iter(tables.values())).shards
    handles = [connection.submit_prepare(label, base=base, refs=refs) for connection in connections]
    described = [
        connection.collect([h], timeout=PREPARE_TIMEOUT_S)[0]
        for connection, h in zip(connections, handles, strict=True)
    ]
    return sharded_tables(described, connections)
