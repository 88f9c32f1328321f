"""Embedding engine: dynamic collisionless tables, fused sparse optimizers, low-precision rows,
admission and eviction, state and delta export. No Ray and no processes in here.

Modules, by concept: ``specs`` (configuration records), ``hashing`` (mixing functions),
``hash_index`` (id -> row), ``initializers`` (deterministic initial rows), ``optimizers`` (fused
sparse updates), ``precision`` (fp32/fp16/int8 row storage), ``admission``, ``eviction``, ``state``
(exported arrays), ``table`` (``EmbeddingTable``), ``tiered_table`` (``TieredTable``: hot rows in
memory, cold rows on disk), ``disk_tier`` (the slab file of cold rows), ``tier_policy`` (which rows
go to disk), ``sizes`` (bytes per row, memory budgets), ``arrays`` (in-place growth), ``prefetch`` (the
software-prefetch intrinsic), ``reference`` (plain NumPy oracles for tests), ``warmup`` (compile
the numba kernels once per process).

    from psrec.embedding import EmbeddingTable, SparseOptimizerSpec, warmup

    warmup()
    table = EmbeddingTable("items", 64, optimizer=SparseOptimizerSpec("rowwise_adagrad", lr=0.05))
    rows = table.pull(ids)                     # ids: 1-D int64; rows: (len(ids), 64) float32
    table.push(ids, grads, step=step)          # grads: (len(ids), 64) float32
"""

from psrec.embedding.hash_index import HashIndex
from psrec.embedding.sizes import planned_bytes_per_row
from psrec.embedding.specs import (
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    StorageSpec,
    TableSpec,
)
from psrec.embedding.state import TableDelta, TableState
from psrec.embedding.table import EmbeddingTable
from psrec.embedding.tiered_table import TieredTable, build_table
from psrec.embedding.warmup import warmup

__all__ = [
    "AdmissionSpec",
    "EmbeddingTable",
    "EvictionSpec",
    "HashIndex",
    "InitializerSpec",
    "SparseOptimizerSpec",
    "StorageSpec",
    "TableDelta",
    "TableSpec",
    "TableState",
    "TieredTable",
    "build_table",
    "planned_bytes_per_row",
    "warmup",
]
