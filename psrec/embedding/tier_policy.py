"""Which hot rows a two-tier table demotes to disk: pure functions over per-row metadata.

The metadata are the table's own ``[count, last step]`` per row (gradient occurrences, saturating,
and the table clock at the last update), which travel with a row between the tiers, so the policy
needs no state of its own:

- ``lfu`` (the default): the fewest updates first (ties: the oldest last step, then the lowest id);
- ``lru``: the oldest last step first (ties: the fewest updates, then the lowest id);
- ``lfu_aging``: frequency with aging, ``count * 2 ** (-(clock - last_step) / half_life)`` lowest
  first (``half_life`` in steps), so rows popular long ago cool down.

``python -m psrec.bench.disk_tier_bench policies`` measures their hit rates on Zipf traffic
(docs/disk_tier.md): on stationary Zipf(1.1) ids, LFU keeps the most hits; aging is a little below it,
LRU well below.

Sampled choice: a table demoting ``n`` rows draws about ``n * VICTIM_SAMPLE`` memory rows uniformly
(``sample_rows``) and demotes the ``n`` coldest of them by the policy, instead of ranking every row in
memory. The cost is then proportional to the rows demoted, not to the memory tier; the rows chosen
are the coldest ``1 / VICTIM_SAMPLE`` of the memory tier in expectation, which on Zipf traffic keeps
the exact choice's hit rate within a fraction of a point (the benchmark's ``policies`` part measures
both).
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lfu", "lru", "lfu_aging")
AGING_HALF_LIFE_STEPS = 1000
VICTIM_SAMPLE = 8  # candidates drawn per row demoted (0: rank every row in memory)


def coldest(
    policy: str,
    count: int,
    *,
    ids: np.ndarray,
    counts: np.ndarray,
    last_step: np.ndarray,
    clock: int,
    half_life: float = AGING_HALF_LIFE_STEPS,
) -> np.ndarray:
    """Positions (into the aligned arrays) of the `count` coldest rows under `policy` (`half_life`:
    steps, for ``lfu_aging``)."""
    if policy not in POLICIES:
        raise ValueError(f"demotion policy must be one of {POLICIES}, got {policy!r}")
    total = ids.shape[0]
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    if count >= total:
        return np.arange(total, dtype=np.int64)
    counts64 = counts.astype(np.uint64)
    steps64 = last_step.astype(np.uint64)
    key: np.ndarray
    if policy == "lfu":
        key = (counts64 << np.uint64(32)) | steps64
    elif policy == "lru":
        key = (steps64 << np.uint64(32)) | counts64
    else:
        age = (np.int64(clock) - last_step.astype(np.int64)).clip(0)
        key = counts.astype(np.float64) * np.exp2(-age / half_life)
    chosen = np.argpartition(key, count - 1)[:count]
    # rows tied with the last one chosen: settle by id so the choice does not depend on row order
    boundary = key[chosen].max()
    below = np.flatnonzero(key < boundary)
    tied = np.flatnonzero(key == boundary)
    tied = tied[np.argsort(ids[tied], kind="stable")[: count - below.shape[0]]]
    return np.concatenate([below, tied]).astype(np.int64)


def sample_rows(
    tags: np.ndarray, slots: np.ndarray, count: int, rng: np.random.Generator, *, excluded: np.ndarray
) -> np.ndarray:
    """About `count` distinct rows of a hash index drawn uniformly (ascending): slot positions drawn
    with replacement, the occupied ones (``tags != 0``) mapped to their rows, duplicates and rows
    where the mask `excluded` (indexed by row) is set dropped. Every live row is equally likely,
    since each occupies one slot. Duplicates are dropped through a mask over the rows (one pass
    over ``excluded.shape[0]`` bytes), not by sorting the draw."""
    capacity = slots.shape[0]
    probe = min(capacity, 4096)
    occupied = max(int(np.count_nonzero(tags[:probe])) / probe, 1e-3)
    positions = rng.integers(0, capacity, size=int(count / occupied) + 1)
    positions = positions[tags[positions] != 0]
    picked = np.zeros(excluded.shape[0], dtype=np.bool_)
    picked[slots[positions]] = True
    picked &= ~excluded
    return np.flatnonzero(picked)
