"""Collisionless dynamic hash index: int64 feature id -> int32 row number.

Layout (chosen to keep the overhead per row small):

- ``tags``: uint8[capacity], 0 for an empty slot, else an 8-bit fingerprint of the key's hash, so a
  probe reads a contiguous byte array and dereferences a stored id only on a fingerprint match
  (false match rate 1/255 per probe).
- ``slots``: int32[capacity], the row number in each occupied slot (linear probing). The home slot
  of a key is ``fastrange32(hash_key(key), capacity)``, so capacity grows by ``INDEX_GROWTH``
  (1.2x, not doubling) when the load would pass ``MAX_LOAD`` (0.85; linear probing stays cheap at
  that load because probes scan the byte tags): 5 bytes per slot, 5.9-7.1 bytes per row.
- ``keys``: int64[row_capacity], the id of each row, stored once (grown by ``ROW_GROWTH``, 1.0625x,
  in place: see ``arrays.grow_rows``).
  Every int64 is a valid id: emptiness is marked in ``tags``, never by a key value.
- ``free_rows``: a stack of row numbers freed by ``remove``; new ids reuse them before growing.

Removal uses backward-shift deletion (no tombstones), so probe sequences stay short after churn.
Lookups run in blocks with software prefetching (``prefetch``) to keep many cache misses in flight.
The hot loops are numba kernels (``cache=True, nogil=True``); their oracle is a plain Python dict
(``tests/embedding/test_hash_index.py`` runs random operation sequences on both). The index is not
thread-safe: one writer at a time.
"""

from __future__ import annotations

import numba
import numpy as np

from psrec.embedding.arrays import grow_rows
from psrec.embedding.hashing import GOLDEN_GAMMA, fastrange32, hash_key, mix64
from psrec.embedding.prefetch import prefetch

MAX_LOAD = 0.85
INDEX_GROWTH = 1.2
ROW_GROWTH = 1.0625
LOOKUP_BLOCK = 64
SHIFT_PREFETCH = 4  # slots ahead of a backward shift's probe whose stored ids are prefetched
INDEX_SLOT_BYTES = 5  # uint8 tag + int32 row
INDEX_SEED = 0x5EED_1DE5
MAX_ROWS = 2**31 - 1


@numba.njit(cache=True, nogil=True, inline="always")
def _fingerprint(hash_value):  # pragma: no cover - numba
    """Non-zero 8-bit tag from the low hash bits (the home slot uses the high bits)."""
    tag = np.uint8(hash_value & np.uint64(0xFF))
    return tag if tag != 0 else np.uint8(1)


@numba.njit(cache=True, nogil=True)
def _lookup_kernel(tags, slots, keys, ids, out_rows):  # pragma: no cover - numba
    """Row of each id or -1; returns the number of misses.

    Three passes per block of ids so that many cache misses are in flight at once: (1) hash and
    prefetch the home tag/slot, (2) scan tags to the first fingerprint match and prefetch that row's
    stored id, (3) verify (continuing the probe on a false match).
    """
    capacity = slots.shape[0]
    count = ids.shape[0]
    positions = np.empty(LOOKUP_BLOCK, dtype=np.int64)
    fingerprints = np.empty(LOOKUP_BLOCK, dtype=np.uint8)
    missing = 0
    for start in range(0, count, LOOKUP_BLOCK):
        end = min(start + LOOKUP_BLOCK, count)
        for i in range(start, end):
            hash_value = hash_key(ids[i], INDEX_SEED)
            position = fastrange32(hash_value, capacity)
            positions[i - start] = position
            fingerprints[i - start] = _fingerprint(hash_value)
            prefetch(tags, position)
            prefetch(slots, position)
        for i in range(start, end):
            position = positions[i - start]
            fingerprint = fingerprints[i - start]
            while True:
                tag = tags[position]
                if tag == 0:
                    position = -1
                    break
                if tag == fingerprint:
                    prefetch(keys, slots[position])
                    break
                position += 1
                if position == capacity:
                    position = 0
            positions[i - start] = position
        for i in range(start, end):
            position = positions[i - start]
            out_rows[i] = -1
            if position < 0:
                missing += 1
                continue
            key = ids[i]
            fingerprint = fingerprints[i - start]
            while True:
                tag = tags[position]
                if tag == 0:
                    missing += 1
                    break
                if tag == fingerprint:
                    row = slots[position]
                    if keys[row] == key:
                        out_rows[i] = row
                        break
                position += 1
                if position == capacity:
                    position = 0
    return missing


@numba.njit(cache=True, nogil=True)
def _insert_kernel(
    tags, slots, keys, ids, out_rows, inserted, free_rows, free_count, next_row
):  # pragma: no cover
    """Find or insert each id; marks ``inserted[i]`` for the first occurrence of a new id.

    Blocks of ids are hashed and their home slots prefetched before the (sequential) inserts.
    """
    capacity = slots.shape[0]
    count = ids.shape[0]
    positions = np.empty(LOOKUP_BLOCK, dtype=np.int64)
    fingerprints = np.empty(LOOKUP_BLOCK, dtype=np.uint8)
    for start in range(0, count, LOOKUP_BLOCK):
        end = min(start + LOOKUP_BLOCK, count)
        for i in range(start, end):
            hash_value = hash_key(ids[i], INDEX_SEED)
            position = fastrange32(hash_value, capacity)
            positions[i - start] = position
            fingerprints[i - start] = _fingerprint(hash_value)
            prefetch(tags, position)
            prefetch(slots, position)
        for i in range(start, end):
            key = ids[i]
            fingerprint = fingerprints[i - start]
            position = positions[i - start]
            while True:
                tag = tags[position]
                if tag == 0:
                    if free_count > 0:
                        free_count -= 1
                        row = free_rows[free_count]
                    else:
                        row = next_row
                        next_row += 1
                    keys[row] = key
                    tags[position] = fingerprint
                    slots[position] = row
                    out_rows[i] = row
                    inserted[i] = True
                    break
                if tag == fingerprint and keys[slots[position]] == key:
                    out_rows[i] = slots[position]
                    inserted[i] = False
                    break
                position += 1
                if position == capacity:
                    position = 0
    return free_count, next_row


@numba.njit(cache=True, nogil=True)
def _remove_kernel(tags, slots, keys, ids, removed_rows, free_rows, free_count):  # pragma: no cover - numba
    """Remove each id that is present (backward-shift deletion); writes its freed row or -1.

    Blocks of ids are hashed and their home tag/slot prefetched, then the stored id behind each home
    slot, before the (sequential) removals, which run in the order of `ids` as without the
    prefetches; the backward shift prefetches the stored ids a few slots ahead of its probe (each
    moved entry's home needs its id)."""
    capacity = slots.shape[0]
    count = ids.shape[0]
    homes = np.empty(LOOKUP_BLOCK, dtype=np.int64)
    for i in range(count):
        if i % LOOKUP_BLOCK == 0:
            end = min(i + LOOKUP_BLOCK, count)
            for j in range(i, end):
                home = fastrange32(hash_key(ids[j], INDEX_SEED), capacity)
                homes[j - i] = home
                prefetch(tags, home)
                prefetch(slots, home)
            for j in range(i, end):
                row = slots[homes[j - i]]
                if row >= 0:
                    prefetch(keys, row)
        key = ids[i]
        hash_value = hash_key(key, INDEX_SEED)
        fingerprint = _fingerprint(hash_value)
        position = homes[i % LOOKUP_BLOCK]
        removed_rows[i] = -1
        while True:
            tag = tags[position]
            if tag == 0:
                break
            if tag == fingerprint and keys[slots[position]] == key:
                row = slots[position]
                removed_rows[i] = row
                free_rows[free_count] = row
                free_count += 1
                empty = position
                probe = position
                while True:
                    probe += 1
                    if probe == capacity:
                        probe = 0
                    if tags[probe] == 0:
                        break
                    ahead = probe + SHIFT_PREFETCH
                    if ahead < capacity and tags[ahead] != 0:
                        prefetch(keys, slots[ahead])
                    home = fastrange32(hash_key(keys[slots[probe]], INDEX_SEED), capacity)
                    if probe > empty:
                        can_move = home <= empty or home > probe
                    else:
                        can_move = home <= empty and home > probe
                    if can_move:
                        tags[empty] = tags[probe]
                        slots[empty] = slots[probe]
                        empty = probe
                tags[empty] = 0
                slots[empty] = -1
                break
            position += 1
            if position == capacity:
                position = 0
    return free_count


@numba.njit(cache=True, nogil=True)
def _rehash_kernel(old_tags, old_slots, keys, next_row, new_tags, new_slots):  # pragma: no cover - numba
    """Re-insert every live row into the new arrays, in row order (stored ids read sequentially)."""
    live = np.zeros(next_row, dtype=np.bool_)
    for old_position in range(old_slots.shape[0]):
        if old_tags[old_position] != 0:
            live[old_slots[old_position]] = True
    capacity = new_slots.shape[0]
    rows = np.empty(LOOKUP_BLOCK, dtype=np.int64)
    positions = np.empty(LOOKUP_BLOCK, dtype=np.int64)
    fingerprints = np.empty(LOOKUP_BLOCK, dtype=np.uint8)
    row = 0
    while row < next_row:
        filled = 0
        while filled < LOOKUP_BLOCK and row < next_row:
            if live[row]:
                hash_value = hash_key(keys[row], INDEX_SEED)
                position = fastrange32(hash_value, capacity)
                rows[filled] = row
                positions[filled] = position
                fingerprints[filled] = _fingerprint(hash_value)
                prefetch(new_tags, position)
                prefetch(new_slots, position)
                filled += 1
            row += 1
        for k in range(filled):
            position = positions[k]
            while new_tags[position] != 0:
                position += 1
                if position == capacity:
                    position = 0
            new_tags[position] = fingerprints[k]
            new_slots[position] = rows[k]


@numba.njit(cache=True, nogil=True)
def _digest_kernel(ids):  # pragma: no cover - numba
    digest = np.uint64(ids.shape[0])
    for i in range(ids.shape[0]):  # independent terms: vectorises
        digest += mix64(np.uint64(ids[i]) ^ (np.uint64(i) * np.uint64(GOLDEN_GAMMA)))
    return digest


def ids_digest(ids: np.ndarray) -> int:
    """A 64-bit digest of an int64 id array (order-sensitive): one sequential pass, no lookups."""
    return int(_digest_kernel(ids))


class HashIndex:
    """Maps int64 ids to row numbers in ``[0, row_capacity)``; rows freed by ``remove`` are reused.

    The owner of the row storage (``EmbeddingTable``) grows its arrays to ``row_capacity`` after
    every insertion.
    """

    def __init__(self, *, initial_rows: int = 0) -> None:
        capacity = self._index_capacity_for(initial_rows)
        self.tags = np.zeros(capacity, dtype=np.uint8)
        self.slots = np.full(capacity, -1, dtype=np.int32)
        self.keys = np.zeros(max(initial_rows, 16), dtype=np.int64)
        self.free_rows = np.zeros(0, dtype=np.int32)
        self.free_count = 0
        self.next_row = 0

    @staticmethod
    def _index_capacity_for(rows: int) -> int:
        return max(16, int(rows / MAX_LOAD) + 1)

    @property
    def num_rows(self) -> int:
        return self.next_row - self.free_count

    @property
    def row_capacity(self) -> int:
        return int(self.keys.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.slots.shape[0])

    def nbytes(self) -> int:
        return int(self.tags.nbytes + self.slots.nbytes + self.keys.nbytes + self.free_rows.nbytes)

    def reserve(self, additional: int) -> None:
        """Make room for ``additional`` more ids (index capacity and row numbers)."""
        needed_rows = self.num_rows + additional
        if needed_rows > MAX_ROWS:
            raise ValueError(f"hash index cannot hold {needed_rows} rows (max {MAX_ROWS})")
        if needed_rows > MAX_LOAD * self.capacity:
            capacity = max(int(self.capacity * INDEX_GROWTH), self._index_capacity_for(needed_rows))
            new_tags = np.zeros(capacity, dtype=np.uint8)
            new_slots = np.full(capacity, -1, dtype=np.int32)
            _rehash_kernel(self.tags, self.slots, self.keys, self.next_row, new_tags, new_slots)
            self.tags, self.slots = new_tags, new_slots
        rows_from_free = min(additional, self.free_count)
        needed_row_numbers = self.next_row + additional - rows_from_free
        if needed_row_numbers > self.keys.shape[0]:
            row_capacity = min(MAX_ROWS, max(int(self.keys.shape[0] * ROW_GROWTH), needed_row_numbers))
            self.keys = grow_rows(self.keys, row_capacity)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Row of each id (-1 where absent) and the number of absent entries."""
        rows = np.empty(ids.shape[0], dtype=np.int32)
        missing = _lookup_kernel(self.tags, self.slots, self.keys, ids, rows)
        return rows, int(missing)

    def insert(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row of each id, inserting absent ids; also a mask of first occurrences of new ids."""
        self.reserve(ids.shape[0])
        rows = np.empty(ids.shape[0], dtype=np.int32)
        inserted = np.empty(ids.shape[0], dtype=np.bool_)
        free_count, next_row = _insert_kernel(
            self.tags,
            self.slots,
            self.keys,
            ids,
            rows,
            inserted,
            self.free_rows,
            self.free_count,
            self.next_row,
        )
        self.free_count, self.next_row = int(free_count), int(next_row)
        return rows, inserted

    def lookup_or_insert(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like ``insert``, but looks everything up first and inserts only the misses."""
        rows, missing = self.lookup(ids)
        inserted = np.zeros(ids.shape[0], dtype=np.bool_)
        if missing:
            positions = np.flatnonzero(rows < 0)
            rows[positions], inserted[positions] = self.insert(ids[positions])
        return rows, inserted

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove the ids that are present; returns each id's freed row or -1."""
        needed = self.free_count + ids.shape[0]
        if needed > self.free_rows.shape[0]:
            self.free_rows = grow_rows(self.free_rows, max(needed, int(self.free_rows.shape[0] * ROW_GROWTH)))
        removed = np.empty(ids.shape[0], dtype=np.int32)
        self.free_count = int(
            _remove_kernel(self.tags, self.slots, self.keys, ids, removed, self.free_rows, self.free_count)
        )
        return removed

    def live_rows(self, *, sort: bool = True) -> np.ndarray:
        """Row numbers currently in use (ascending if ``sort``, else in slot order)."""
        rows = self.slots[self.tags != 0]
        if sort:
            rows.sort()
        return rows
