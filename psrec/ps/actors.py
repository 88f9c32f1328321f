"""Ray actors for the parameter server, and the connection the trainer-side client uses.

`ShardActor` builds its tables from plain `TableSpec`s inside its own process and wraps a
`ParameterShard`; `RayConnection` adapts an actor handle to the client's `ShardConnection`
protocol. NumPy arrays travel zero-copy through Ray's object store (they arrive read-only).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint
from psrec.embedding import EmbeddingTable, TableSpec, warmup
from psrec.ps.client import Pending
from psrec.ps.shard import ParameterShard, TableGradients
from psrec.ps.shard_checkpoint import restore_shard, write_shard_checkpoint
from psrec.ps.wire import check_precision, decode_gradients, encode_rows
from psrec.threads import set_thread_counts

# ParameterShard's maintenance methods a driver may call through `ShardActor.call`.
MAINTENANCE_METHODS = frozenset(
    {
        "stats",
        "evict",
        "save_snapshot",
        "restore_snapshot",
        "set_learning_rate",
        "table_rows",
        "confirm_checkpoint",
        "record_versions",
        "version_log",
    }
)


class ShardActor:
    """One PS shard process (created with `ray.remote(ShardActor).options(...).remote(...)`).

    ``num_trainers`` is the number of trainers whose pushes complete a sync step; ``wire_precision``
    the precision of the rows it sends back (`psrec.ps.wire`).
    """

    def __init__(
        self,
        shard_index: int,
        tables: list[TableSpec],
        *,
        num_trainers: int,
        mode: str,
        wire_precision: str = "fp32",
        threads: int = 1,
    ) -> None:
        set_thread_counts(threads)
        check_precision(wire_precision)
        self.wire_precision = wire_precision
        warmup()
        self.shard = ParameterShard(
            shard_index,
            {spec.name: EmbeddingTable.from_spec(spec) for spec in tables},
            num_trainers=num_trainers,
            mode=mode,
        )

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> dict[str, Any]:
        return actor_location()

    def pull(self, requests: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        rows = self.shard.pull(requests, train=train)
        return {name: encode_rows(values, self.wire_precision) for name, values in rows.items()}

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> bool:
        decoded = {name: (ids, decode_gradients(grads)) for name, (ids, grads) in gradients.items()}
        return self.shard.push(trainer, request_id, step, decoded)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one of ParameterShard's `MAINTENANCE_METHODS` (stats, evict, snapshots, learning rate)."""
        if method not in MAINTENANCE_METHODS:
            raise ValueError(f"ShardActor.call: unknown method {method!r}")
        return getattr(self.shard, method)(*args, **kwargs)

    def write_checkpoint(self, pending: PendingCheckpoint, kind: str) -> FileRecord:
        """Write this shard's file of a pending checkpoint (shards write in parallel)."""
        return write_shard_checkpoint(self.shard, pending, kind)

    def restore(self, chain: list[CheckpointRef], step: int) -> None:
        restore_shard(self.shard, chain, step)


class _RayPending:
    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def result(self) -> Any:
        import ray

        return ray.get(self.ref)


class RayConnection:
    """The client's view of a `ShardActor` handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def pull(self, requests: dict[str, np.ndarray], *, train: bool) -> Pending:
        return _RayPending(self.actor.pull.remote(requests, train))

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending:
        return _RayPending(self.actor.push.remote(trainer, request_id, step, gradients))


def actor_location() -> dict[str, Any]:
    """The Ray node the calling actor runs on and its process id (for the placement report)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }
