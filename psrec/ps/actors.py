"""Ray actors for the parameter server, and the connection the trainer-side client uses.

`ShardActor` builds its tables from the run config inside its own process and wraps a
`ParameterShard`; `RayConnection` adapts an actor handle to the client's `ShardConnection`
protocol. NumPy arrays travel zero-copy through Ray's object store (they arrive read-only).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psrec.ps.client import Pending
from psrec.ps.shard import ParameterShard, TableGradients
from psrec.ps.wire import decode_gradients, encode_rows


def set_thread_counts(threads: int) -> None:
    """Pin torch/numba/OpenMP threads: processes sharing cores must not spin-wait on each other."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    except (ImportError, ValueError):  # pragma: no cover
        pass


class ShardActor:
    """One PS shard process (created with `ray.remote(ShardActor).options(...).remote(...)`)."""

    def __init__(self, shard_index: int, config: dict[str, Any], *, threads: int = 1) -> None:
        set_thread_counts(threads)
        from psrec.config import RunConfig
        from psrec.embedding import warmup
        from psrec.train.builders import build_tables, pushing_trainers

        run_config = RunConfig.model_validate(config)
        self.wire_precision = run_config.ps.wire_precision
        warmup()
        self.shard = ParameterShard(
            shard_index,
            build_tables(run_config, partitions=run_config.ps.num_shards),
            num_trainers=pushing_trainers(run_config),
            mode=run_config.ps.mode,
        )

    def pid(self) -> int:
        return os.getpid()

    def pull(self, requests: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        rows = self.shard.pull(requests, train=train)
        return {name: encode_rows(values, self.wire_precision) for name, values in rows.items()}

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> bool:
        decoded = {name: (ids, decode_gradients(grads)) for name, (ids, grads) in gradients.items()}
        return self.shard.push(trainer, request_id, step, decoded)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one of ParameterShard's maintenance methods (stats, evict, snapshots, learning rate)."""
        if method not in {
            "stats",
            "evict",
            "save_snapshot",
            "restore_snapshot",
            "set_learning_rate",
            "table_rows",
            "confirm_checkpoint",
        }:
            raise ValueError(f"ShardActor.call: unknown method {method!r}")
        return getattr(self.shard, method)(*args, **kwargs)

    def write_checkpoint(self, pending: Any, kind: str) -> Any:
        """Write this shard's file of a pending checkpoint (shards write in parallel)."""
        return write_shard_checkpoint(self.shard, pending, kind)

    def restore(self, chain: list[Any], step: int) -> None:
        restore_shard(self.shard, chain, step)

    def counters(self) -> dict[str, int]:
        return {
            "applied_step": self.shard.applied_step,
            "pushes_applied": self.shard.pushes_applied,
            "pushes_dropped": self.shard.pushes_dropped,
        }


def write_shard_checkpoint(shard: ParameterShard, pending: Any, kind: str) -> Any:
    from psrec.train.checkpoint import write_shard

    return write_shard(pending, shard.shard_index, shard.checkpoint_arrays(kind))


def restore_shard(shard: ParameterShard, chain: list[Any], step: int) -> None:
    """Load this shard's file of each checkpoint of `chain` (full first, then deltas) into its tables."""
    from psrec.train.checkpoint import load_checkpoint

    arrays = [
        (ref.kind, load_checkpoint(ref, shards=[shard.shard_index], dense=False).shards[shard.shard_index])
        for ref in chain
    ]
    shard.restore_arrays(arrays, step=step)


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
