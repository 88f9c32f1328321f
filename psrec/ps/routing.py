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

import numba
import numpy as np

from psrec.embedding.hashing import GOLDEN_GAMMA, mix64, mix64_numpy

_PROBE = np.uint64(GOLDEN_GAMMA)  # 2**64 / golden ratio: Fibonacci hashing of the dedup's probes


def bucket_of(ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """Virtual bucket (int64 in [0, num_buckets)) of each int64 id, via the splitmix64 finaliser.

    Feature ids are often sequential or share low bits; the finaliser spreads them evenly.
    """
    x = mix64_numpy(ids.astype(np.int64, copy=False).view(np.uint64))
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
    """Ids split by owning shard, plus what is needed to put per-shard results back in order.

    `order` None means the ids are already grouped by shard (as `dedup_and_route` leaves them):
    splitting is slicing and gathering is concatenating, with no index copies.
    """

    ids_per_shard: list[np.ndarray]
    order: np.ndarray | None  # (n,) positions of the input ids, grouped by shard (stable within a shard)
    splits: np.ndarray  # (num_shards + 1,) boundaries of each shard's group within `order`

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """Split per-id values (e.g. gradients, aligned with the routed ids) the same way as the ids."""
        grouped = values if self.order is None else values[self.order]
        return [grouped[self.splits[s] : self.splits[s + 1]] for s in range(len(self.ids_per_shard))]

    def gather(self, per_shard: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Inverse of `split`: per-shard results -> one array in the order of the original ids
        (written into `out` when given)."""
        first = next((p for p in per_shard if p is not None), None)
        if first is None:
            raise ValueError("gather needs at least one shard result")
        if out is None:
            out = np.empty((int(self.splits[-1]), *first.shape[1:]), dtype=first.dtype)
        for shard, part in enumerate(per_shard):
            start, stop = self.splits[shard], self.splits[shard + 1]
            if self.order is None:
                out[start:stop] = part
            else:
                out[self.order[start:stop]] = part
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


@numba.njit(cache=True, nogil=True)
def _dedup_and_route(
    ids: np.ndarray, table_starts: np.ndarray, bucket_to_shard: np.ndarray, columns: np.ndarray, batch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    num_tables = table_starts.size - 1
    num_columns = columns.size
    num_buckets = np.uint64(bucket_to_shard.size)
    num_shards = 0
    for b in range(bucket_to_shard.size):
        num_shards = max(num_shards, bucket_to_shard[b] + 1)
    unique = np.empty(ids.size, dtype=np.int64)
    inverse = np.empty(ids.size, dtype=np.int64)
    counts = np.zeros((num_tables, num_shards), dtype=np.int64)
    unique_starts = np.zeros(num_tables + 1, dtype=np.int64)
    largest = 1
    for t in range(num_tables):
        largest = max(largest, table_starts[t + 1] - table_starts[t])
    capacity = 16
    while capacity < 2 * largest:
        capacity *= 2
    slot_row = np.empty(capacity, dtype=np.int64)
    local_ids = np.empty(largest, dtype=np.int64)
    local_shard = np.empty(largest, dtype=np.int64)
    local_inverse = np.empty(largest, dtype=np.int64)
    new_position = np.empty(largest, dtype=np.int64)
    next_in_shard = np.empty(num_shards, dtype=np.int64)
    written = 0
    for t in range(num_tables):
        first, last = table_starts[t], table_starts[t + 1]
        bits = 4
        while (1 << bits) < 2 * (last - first):
            bits += 1
        mask = (1 << bits) - 1
        shift = np.uint64(64 - bits)
        slot_row[: mask + 1] = -1
        found = 0
        for i in range(first, last):
            value = ids[i]
            # the probe's slot: a multiplicative hash (top bits); the bucket hash only for new ids
            slot = np.int64((np.uint64(value) * _PROBE) >> shift)
            while True:
                row = slot_row[slot]
                if row < 0:
                    slot_row[slot] = found
                    local_ids[found] = value
                    shard = 0
                    if num_shards > 1:  # the bucket of `bucket_of`
                        shard = bucket_to_shard[np.int64(mix64(np.uint64(value)) % num_buckets)]
                    local_shard[found] = shard
                    counts[t, shard] += 1
                    local_inverse[i - first] = found
                    found += 1
                    break
                if local_ids[row] == value:
                    local_inverse[i - first] = row
                    break
                slot = (slot + 1) & mask
        # stable counting sort by shard: each shard's ids contiguous, first-occurrence order within
        position = written
        for s in range(num_shards):
            next_in_shard[s] = position
            position += counts[t, s]
        for u in range(found):
            target = next_in_shard[local_shard[u]]
            next_in_shard[local_shard[u]] += 1
            unique[target] = local_ids[u]
            new_position[u] = target
        if batch > 0:  # sample major: block k of `batch` ids is column columns[k] of (batch, num_columns)
            for block_start in range(first, last, batch):  # blocks, so no division per id
                column = columns[block_start // batch]
                for j in range(batch):
                    inverse[j * num_columns + column] = new_position[local_inverse[block_start + j - first]]
        else:
            for i in range(first, last):
                inverse[i] = new_position[local_inverse[i - first]]
        written += found
        unique_starts[t + 1] = written
    return unique[:written], inverse, unique_starts, counts


def dedup_and_route(
    ids: np.ndarray,
    table_starts: np.ndarray,
    bucket_to_shard: np.ndarray,
    *,
    sample_major: tuple[int, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Deduplicate and route the ids of several tables in one pass (the client's plan step).

    `ids` holds every table's ids back to back, table t's at ``ids[table_starts[t]:table_starts[t+1]]``.
    Returns ``(unique, inverse, unique_starts, counts)``: table t's distinct ids are
    ``unique[unique_starts[t]:unique_starts[t+1]]``, grouped by owning shard (shard 0's first, each
    group in first-occurrence order, ``counts[t, s]`` ids for shard s); ``unique[inverse[i]] == ids[i]``
    (positions into all of `unique`). Shards are those of `route` (the same bucket hash).

    ``sample_major=(batch, columns)``, for ids that are blocks of `batch` (one id per sample of a
    single-valued feature), returns `inverse` transposed instead: block k is column ``columns[k]`` of
    a sample-major ``(batch, len(columns))`` layout, flattened (the pooling gather's index, written in
    the same pass, with no per-feature copies).
    """
    if bucket_to_shard.size == 0:
        raise ValueError("the bucket map is empty")
    batch, columns = 0, np.zeros(0, dtype=np.int64)
    if sample_major is not None:
        batch, columns = sample_major
        columns = np.ascontiguousarray(columns, dtype=np.int64)
        if batch <= 0 or ids.size != batch * columns.size:
            raise ValueError(f"sample_major: {ids.size} ids are not {columns.size} blocks of {batch}")
        if not np.array_equal(np.sort(columns), np.arange(columns.size)):
            raise ValueError("sample_major: columns must be a permutation of range(len(columns))")
    return _dedup_and_route(
        np.ascontiguousarray(ids, dtype=np.int64),
        np.ascontiguousarray(table_starts, dtype=np.int64),
        np.ascontiguousarray(bucket_to_shard, dtype=np.int64),
        columns,
        int(batch),
    )
