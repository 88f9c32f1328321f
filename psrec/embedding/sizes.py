"""What a table's rows cost in memory and on disk, for capacity planning and memory budgets.

``planned_bytes_per_row`` is one in-memory row (payload, optimizer state, index and metadata);
``DISK_INDEX_BYTES_PER_ROW`` what a row on the disk tier still costs in memory (its slot in the
disk tier's index, its stored id, ``[count, last step]`` and its slot in the file);
``disk_bytes_per_row`` its record in the slab file, which holds up to ``DISK_SPACE_FACTOR`` slots
per row (garbage of the log-structured slab: ``slab_log``); ``memory_rows_for_budget`` how many rows
fit in memory when the table holds ``expected_rows`` in all and everything, the disk tier's index
included, must fit ``budget_bytes``.
"""

from __future__ import annotations

import numpy as np

from psrec.embedding.hash_index import INDEX_GROWTH, INDEX_SLOT_BYTES, MAX_LOAD, ROW_GROWTH
from psrec.embedding.optimizers import STATE_LAYOUT
from psrec.embedding.slab_log import CLEAN_MAX_LIVE

# index slot (worst point of its growth cycle) + stored id + [count, last step] + int32 file slot,
# the per-row arrays grown by ROW_GROWTH
DISK_INDEX_BYTES_PER_ROW = INDEX_SLOT_BYTES * INDEX_GROWTH / MAX_LOAD + 20 * ROW_GROWTH
# file slots per row on disk at most: segments are cleaned once at most CLEAN_MAX_LIVE of them is
# live, and the file grows by a quarter (disk_tier.SLAB_GROWTH) when none is
DISK_SPACE_FACTOR = 1.25 / CLEAN_MAX_LIVE


def planned_bytes_per_row(dim: int, *, precision: str, optimizer: str) -> dict[str, float]:
    """Bytes one row costs at scale, for capacity planning: payload and optimizer state (exact, per
    row) and the overhead (index slots + stored id + count + last step) at the best and worst point
    of the growth cycle, reserved-but-unused capacity included."""
    payload = {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 8}[precision]
    state = sum(
        (dim if kind == "element" else 1) * np.dtype(dtype).itemsize
        for _, kind, dtype in STATE_LAYOUT[optimizer]
    )
    per_row = 8 + 8  # stored id + [count, last step]
    return {
        "payload": float(payload),
        "optimizer": float(state),
        "overhead_best": INDEX_SLOT_BYTES / MAX_LOAD + per_row,
        "overhead_worst": INDEX_SLOT_BYTES * INDEX_GROWTH / MAX_LOAD + per_row * ROW_GROWTH,
    }


def disk_bytes_per_row(dim: int, *, precision: str, optimizer: str) -> int:
    """Bytes of one row's record in the disk tier's file (payload, state, metadata, id, checksum)."""
    sizes = planned_bytes_per_row(dim, precision=precision, optimizer=optimizer)
    content = int(sizes["payload"] + sizes["optimizer"]) + 8 + 8  # + [count, last step] + id
    return (content + 7) // 8 * 8 + 8


def memory_rows_for_budget(
    budget_bytes: float, *, dim: int, precision: str, optimizer: str, expected_rows: int = 0
) -> int:
    """Rows a table may keep in memory within `budget_bytes`: each memory row at its worst-case cost,
    and each of the other `expected_rows` at ``DISK_INDEX_BYTES_PER_ROW``; raises ValueError when the
    budget cannot hold even the disk tier's index."""
    sizes = planned_bytes_per_row(dim, precision=precision, optimizer=optimizer)
    hot = sizes["payload"] + sizes["optimizer"] + sizes["overhead_worst"]
    cold_index = DISK_INDEX_BYTES_PER_ROW * expected_rows
    rows = int((budget_bytes - cold_index) / (hot - DISK_INDEX_BYTES_PER_ROW))
    if rows < 1:
        raise ValueError(
            f"a memory budget of {budget_bytes / 2**20:.1f} MiB cannot hold the disk tier's index of "
            f"{expected_rows} rows ({cold_index / 2**20:.1f} MiB at {DISK_INDEX_BYTES_PER_ROW:.1f} B a row) "
            "and a memory row: raise the budget"
        )
    return min(rows, expected_rows) if expected_rows else rows
