"""A shard's part of a checkpoint: write its file into a pending checkpoint, restore it from a chain.

The same two calls serve a shard actor, an in-process shard and a collective trainer's local
partition: each writes only its own file (in parallel with the others) and reads only its own file of
each checkpoint of the chain.
"""

from __future__ import annotations

import numpy as np

from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint, load_checkpoint, write_shard
from psrec.ps.shard import ParameterShard


def write_shard_checkpoint(shard: ParameterShard, pending: PendingCheckpoint, kind: str) -> FileRecord:
    """Write `shard`'s full or delta arrays as its file of `pending`."""
    return write_shard(pending, shard.shard_index, shard.checkpoint_arrays(kind))


def restore_shard(shard: ParameterShard, chain: list[CheckpointRef], step: int) -> None:
    """Load this shard's file of each checkpoint of `chain` (full first, then deltas) into its tables."""
    arrays: list[tuple[str, dict[str, np.ndarray]]] = [
        (ref.kind, load_checkpoint(ref, shards=[shard.shard_index], dense=False).shards[shard.shard_index])
        for ref in chain
    ]
    shard.restore_arrays(arrays, step=step)
