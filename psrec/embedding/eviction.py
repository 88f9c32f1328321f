"""Eviction decisions as pure functions over per-row metadata (no table, no mutation).

``rows_to_evict`` returns the rows to remove under an ``EvictionSpec`` at ``step``:

1. TTL: rows with ``step - last_step > ttl_steps``;
2. capacity: among the rest, the least frequently updated rows (lowest ``counts``; ties broken by the
   oldest ``last_step``, then the lowest id) until at most ``max_rows`` remain.

The table applies the decision with ``EmbeddingTable.remove``-like bookkeeping.
"""

from __future__ import annotations

import numpy as np

from psrec.embedding.specs import EvictionSpec


def rows_to_evict(
    spec: EvictionSpec,
    *,
    step: int,
    rows: np.ndarray,
    ids: np.ndarray,
    counts: np.ndarray,
    last_step: np.ndarray,
) -> np.ndarray:
    """Subset of ``rows`` to evict; ``ids``/``counts``/``last_step`` are aligned with ``rows``."""
    evict = np.zeros(rows.shape[0], dtype=np.bool_)
    if spec.ttl_steps is not None:
        evict |= (np.int64(step) - last_step.astype(np.int64)) > spec.ttl_steps
    if spec.max_rows is not None:
        surviving = np.flatnonzero(~evict)
        excess = surviving.shape[0] - spec.max_rows
        if excess > 0:
            order = np.lexsort((ids[surviving], last_step[surviving], counts[surviving]))
            evict[surviving[order[:excess]]] = True
    return rows[evict]
