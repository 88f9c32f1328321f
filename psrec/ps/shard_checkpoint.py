"""A shard's part of a checkpoint: write its file into a pending checkpoint, restore it from a chain.

The same two calls serve a shard actor, an in-process shard and a collective trainer's local
partition: each writes only its own file (in parallel with the others) and reads only its own file of
each checkpoint of the chain (the chain's files in parallel). A pending checkpoint names its
storage by path or URI only: each shard process opens the store itself and uploads its own file.
"""

from __future__ import annotations

import numpy as np

from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint, write_shard
from psrec.checkpoint.load import load_chain
from psrec.ps.shard import ParameterShard


def write_shard_checkpoint(shard: ParameterShard, pending: PendingCheckpoint, kind: str) -> FileRecord:
    """Write `shard`'s full or delta arrays as its file of `pending`."""
    return write_shard(pending, shard.shard_index, shard.checkpoint_arrays(kind))


def restore_shard(shard: ParameterShard, chain: list[CheckpointRef], step: int) -> None:
    """Load this shard's file of each checkpoint of `chain` (full first, then deltas) into its tables."""
    loaded = load_chain(chain, shards=[shard.shard_index])
    arrays: list[tuple[str, dict[str, np.ndarray]]] = [
        (ref.kind, data.shards[shard.shard_index]) for ref, data in zip(chain, loaded, strict=True)
    ]
    shard.restore_arrays(arrays, step=step)
