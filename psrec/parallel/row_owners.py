"""Which trainer owns each row under collective sharding: the "route" step, as pure functions.

A `Placement` says, for every table, whether it lives whole on one rank (table-wise, `owner`) or is
split over all ranks by virtual bucket (row-wise, through the same `bucket_of` hash and bucket map as
the parameter server, `psrec.ps.routing`). `Placement.route(table, ids)` returns a `Routed` (ids per
rank, and `split`/`gather` to put per-rank values back in batch order), exactly like `routing.route`.

The dim-1 companion table of first-order weights (``"<table>__linear"``) lives with its table.

    placement = Placement.row_wise(num_ranks=2, num_buckets=64)
    routed = placement.route("C1", ids)        # routed.ids_per_shard[r]: the ids rank r serves
    rows = routed.gather(rows_from_each_rank)  # (len(ids), dim), in the order of `ids`
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from psrec.parallel.planner import ShardingPlan
from psrec.ps.client import LINEAR_SUFFIX
from psrec.ps.routing import Routed, default_bucket_map, route


@dataclass(frozen=True)
class Placement:
    num_ranks: int
    bucket_to_rank: np.ndarray  # (num_buckets,) for the row-wise tables
    owners: dict[str, int] = field(default_factory=dict)  # table-wise tables -> owning rank

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        bad = {t: r for t, r in self.owners.items() if not 0 <= r < self.num_ranks}
        if bad:
            raise ValueError(f"table owners outside ranks 0..{self.num_ranks - 1}: {bad}")
        if self.bucket_to_rank.size and int(self.bucket_to_rank.max()) >= self.num_ranks:
            raise ValueError("bucket map names a rank >= num_ranks")

    @staticmethod
    def row_wise(num_ranks: int, num_buckets: int = 1024) -> Placement:
        """Every table split over all ranks by bucket."""
        return Placement(num_ranks, default_bucket_map(num_buckets, num_ranks))

    @staticmethod
    def table_wise(tables: list[str], num_ranks: int, num_buckets: int = 1024) -> Placement:
        """Whole tables, dealt round-robin in the given order (use the planner to balance by size)."""
        owners = {table: index % num_ranks for index, table in enumerate(tables)}
        return Placement(num_ranks, default_bucket_map(num_buckets, num_ranks), owners)

    @staticmethod
    def from_plan(plan: ShardingPlan) -> Placement:
        if plan.strategy != "collective":
            raise ValueError(
                f"a collective placement needs a collective plan, got strategy {plan.strategy!r}"
            )
        owners = {t: owner for t, owner in plan.owners().items() if owner is not None}
        return Placement(plan.num_devices, plan.bucket_map(), owners)

    def owner_of(self, table: str) -> int | None:
        """The rank holding all of `table`, or None when it is row-wise."""
        base = table[: -len(LINEAR_SUFFIX)] if table.endswith(LINEAR_SUFFIX) else table
        return self.owners.get(table, self.owners.get(base))

    def route(self, table: str, ids: np.ndarray) -> Routed:
        owner = self.owner_of(table)
        if owner is None:
            routed = route(ids, self.bucket_to_rank)
            if len(routed.ids_per_shard) == self.num_ranks:
                return routed
            # An empty id array yields fewer groups; pad so there is one per rank.
            missing = self.num_ranks - len(routed.ids_per_shard)
            empty = ids[:0]
            splits = np.concatenate([routed.splits, np.full(missing, routed.splits[-1])])
            return Routed([*routed.ids_per_shard, *([empty] * missing)], routed.order, splits)
        splits = np.zeros(self.num_ranks + 1, dtype=np.int64)
        splits[owner + 1 :] = ids.size
        parts = [ids[:0]] * self.num_ranks
        parts[owner] = ids
        return Routed(parts, np.arange(ids.size, dtype=np.int64), splits)
