"""Route ids to parameter-server shards: id -> virtual bucket -> shard.

Ids are hashed into a fixed number of virtual buckets (`num_buckets`, e.g. 1024) and a bucket map
assigns buckets to shards. Re-balancing moves whole buckets between shards without rehashing any
id, and the map is plain data that checkpoints store.

This module is the "route" and "return" of route -> compute -> return; all functions are pure and
work on NumPy arrays:

    routed = route(ids, bucket_to_shard)          # ids of each shard, in a fixed order
    rows_per_shard = [shard.pull(ids) for ...]     # compute (elsewhere)
    rows = routed.gather(rows_per_shard)           # back in the order of `ids`
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def bucket_of(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """Virtual bucket (int64 in [0, num_buckets)) of each int64 id, via the splitmix64 finaliser.

    Feature ids are often sequential or share low bits; the finaliser spreads them evenly.
    """
    x = ids.astype(np.int64, copy=False).view(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(num_buckets)).astype(np.int64)


def default_bucket_map(num_buckets: int, num_shards: int) -> np.ndarray:
    """Bucket -> shard in contiguous blocks (re-balancing later moves blocks). Shape (num_buckets,)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards > num_buckets:
        raise ValueError(
            f"{num_shards} shards need at least as many virtual buckets, got num_buckets={num_buckets}"
        )
    return (np.arange(num_buckets, dtype=np.int64) * num_shards) // num_buckets


@dataclass(frozen=True)
class Routed:
    """Ids split by owning shard, plus what is needed to put per-shard results back in order."""

    ids_per_shard: list[np.ndarray]
    order: np.ndarray  # (n,) positions of the input ids, grouped by shard (stable within a shard)
    splits: np.ndarray  # (num_shards + 1,) boundaries of each shard's group within `order`

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """Split per-id values (e.g. gradients, aligned with the routed ids) the same way as the ids."""
        grouped = values[self.order]
        return [grouped[self.splits[s] : self.splits[s + 1]] for s in range(len(self.ids_per_shard))]

    def gather(self, per_shard: list[np.ndarray]) -> np.ndarray:
        """Inverse of `split`: per-shard results -> one array in the order of the original ids."""
        first = next((p for p in per_shard if p is not None), None)
        if first is None:
            raise ValueError("gather needs at least one shard result")
        out = np.empty((self.order.size, *first.shape[1:]), dtype=first.dtype)
        for shard, part in enumerate(per_shard):
            out[self.order[self.splits[shard] : self.splits[shard + 1]]] = part
        return out


def route(ids: np.ndarray, bucket_to_shard: np.ndarray) -> Routed:
    """Group `ids` by the shard that owns them (through their virtual bucket)."""
    num_shards = int(bucket_to_shard.max()) + 1 if bucket_to_shard.size else 1
    shard = bucket_to_shard[bucket_of(ids, bucket_to_shard.size)]
    order = np.argsort(shard, kind="stable")
    counts = np.bincount(shard, minlength=num_shards)
    splits = np.zeros(num_shards + 1, dtype=np.int64)
    np.cumsum(counts, out=splits[1:])
    grouped = ids[order]
    return Routed([grouped[splits[s] : splits[s + 1]] for s in range(num_shards)], order, splits)
