"""Compile (or load from numba's on-disk cache) every embedding kernel on tiny inputs.

Call ``warmup()`` once when a process that will serve tables starts (a PS shard, a benchmark), so
the first real batch does not pay for compilation. It took ~8 s with a cold numba cache and ~0.6 s
with a warm one (``__pycache__`` next to the modules, or ``NUMBA_CACHE_DIR``) on the 2-vCPU box.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from psrec.embedding.specs import (
    OPTIMIZER_NAMES,
    PRECISIONS,
    AdmissionSpec,
    EvictionSpec,
    SparseOptimizerSpec,
)
from psrec.embedding.table import EmbeddingTable

logger = logging.getLogger(__name__)


def warmup() -> float:
    """Run every kernel once; returns the seconds it took."""
    start = time.perf_counter()
    ids = np.array([3, -1, 3, np.iinfo(np.int64).min], dtype=np.int64)
    grads = np.full((ids.shape[0], 4), 0.5, dtype=np.float32)
    for precision in PRECISIONS:
        for optimizer in OPTIMIZER_NAMES:
            for admission in (AdmissionSpec(), AdmissionSpec("min_count", min_count=2, sketch_width=64)):
                table = EmbeddingTable(
                    "warmup",
                    4,
                    optimizer=SparseOptimizerSpec(optimizer),
                    precision=precision,
                    stochastic_rounding=precision != "fp32",
                    admission=admission,
                    eviction=EvictionSpec(max_rows=1),
                )
                table.pull(ids)
                table.push(ids, grads, step=1)
                table.pull(ids, train=False)
                table.evict(step=2)
                table.remove(ids[:1])
    EmbeddingTable(
        "warmup", 4, optimizer=SparseOptimizerSpec("sgd"), admission=AdmissionSpec("probability")
    ).pull(ids)
    seconds = time.perf_counter() - start
    logger.debug("embedding kernels warmed up in %.2fs", seconds)
    return seconds
