"""Adding shards when the tables outgrow them (``ps.autoscale``): the decision, as a pure function.

Between the trainers' chunks of steps, while no resharding is in progress, the driver asks every
shard how many bytes its rows take (`psrec.ps.shard.ParameterShard.stats`: ``row_bytes``, the rows
held in memory with their optimizer state, index entries and metadata). When the fullest shard holds
more than ``max_shard_memory_gb``, the shard count grows to what holds all rows at ``fill`` of the
limit per shard (at least one shard more, at most ``max_shards``), and the resharding goes on as a
``psrec scale`` request does (`psrec.elastic.resharding`). Buckets balance the rows across shards as
hashing balances ids, so after the move each shard holds about ``fill`` of the limit and the next
growth comes only when the tables have grown by about ``1 / fill`` again.

    decide([3 << 30, 1 << 30], limit_bytes=2 << 30, max_shards=8, fill=0.75)
    # -> Grow(shards=3, reason="shard 0 holds 3 GiB of rows, over ps.autoscale.max_shard_memory_gb=2")
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = float(2**30)


@dataclass(frozen=True)
class Grow:
    """Reshard to `shards` shards, for `reason`."""

    shards: int
    reason: str


@dataclass(frozen=True)
class AtLimit:
    """The tables pass the limit, but ``max_shards`` shards run already."""

    reason: str


def decide(
    shard_bytes: list[int], *, limit_bytes: float, max_shards: int, fill: float
) -> Grow | AtLimit | None:
    """What to do about shards holding `shard_bytes` bytes of rows each (None: nothing)."""
    if not shard_bytes:
        return None
    fullest = max(range(len(shard_bytes)), key=lambda index: shard_bytes[index])
    if shard_bytes[fullest] <= limit_bytes:
        return None
    held = (
        f"shard {fullest} holds {shard_bytes[fullest] / GIB:.3g} GiB of rows, over "
        f"ps.autoscale.max_shard_memory_gb={limit_bytes / GIB:g}"
    )
    current = len(shard_bytes)
    if current >= max_shards:
        return AtLimit(
            f"{held}, and ps.autoscale.max_shards={max_shards} shards run already: raise max_shards, "
            "give the tables a disk tier (embedding.*.storage) or evict rows (embedding.*.eviction)"
        )
    wanted = math.ceil(sum(shard_bytes) / (fill * limit_bytes))
    return Grow(min(max(wanted, current + 1), max_shards), held)
