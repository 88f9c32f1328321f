"""A shard's part of a checkpoint: write its file into a pending checkpoint, restore it from a chain.

The same two calls serve a shard actor, an in-process shard and a collective trainer's local
partition: each writes only its own file (in parallel with the others) and reads only its own file of
each checkpoint of the chain (the chain's files in parallel). A pending checkpoint names its
storage by path or URI only: each shard process opens the store itself and uploads its own file.
A checkpoint written with another shard count restores too: every old file is read and each shard
keeps the rows it owns now (`restore_shard` with the new bucket map).
"""

from __future__ import annotations

import logging

import numpy as np

from psrec.checkpoint import (
    CheckpointRef,
    FileRecord,
    PendingCheckpoint,
    load_checkpoint,
    read_manifest,
    write_shard,
)
from psrec.checkpoint.load import load_chain
from psrec.ps.reshard import arrays_for_shard
from psrec.ps.routing import bucket_of
from psrec.ps.shard import ParameterShard

logger = logging.getLogger(__name__)


def write_shard_checkpoint(shard: ParameterShard, pending: PendingCheckpoint, kind: str) -> FileRecord:
    """Write `shard`'s full or delta arrays as its file of `pending`."""
    return write_shard(pending, shard.shard_index, shard.checkpoint_arrays(kind))


def restore_shard(
    shard: ParameterShard, chain: list[CheckpointRef], step: int, *, bucket_map: np.ndarray | None = None
) -> None:
    """Load this shard's file of each checkpoint of `chain` (full first, then deltas) into its tables.

    With `bucket_map` (bucket -> shard of the layout this shard belongs to), a checkpoint of the
    chain written by another layout (another shard count or bucket map) is read whole, and the rows
    whose bucket this shard owns are kept (`psrec.ps.reshard`).
    """
    index = shard.shard_index
    layouts = [_written_layout(ref) for ref in chain] if bucket_map is not None else []
    foreign = [
        bucket_map is not None and (written_map != bucket_map.tolist() or index not in written_shards)
        for written_shards, written_map in layouts
    ]
    if not any(foreign):
        loaded = load_chain(chain, shards=[index])
        own: list[tuple[str, dict[str, np.ndarray]]] = [
            (ref.kind, data.shards[index]) for ref, data in zip(chain, loaded, strict=True)
        ]
        shard.restore_arrays(own, step=step)
        return
    assert bucket_map is not None
    owner = bucket_map

    def owns(ids: np.ndarray) -> np.ndarray:
        return np.asarray(owner[bucket_of(ids, owner.size)] == index)

    arrays: list[tuple[str, dict[str, np.ndarray]]] = []
    for ref, is_foreign, (written_shards, _) in zip(chain, foreign, layouts, strict=True):
        if not is_foreign:
            arrays.append((ref.kind, load_checkpoint(ref, shards=[index], dense=False).shards[index]))
            continue
        data = load_checkpoint(ref, shards=written_shards, dense=False)
        arrays.append((ref.kind, arrays_for_shard([data.shards[i] for i in written_shards], owns=owns)))
    logger.info(
        "shard %d: restored from %d checkpoint(s) written by another layout (%s shards)",
        index,
        sum(foreign),
        ", ".join(str(len(written)) for (written, _), f in zip(layouts, foreign, strict=True) if f),
    )
    shard.restore_arrays(arrays, step=step)


def _written_layout(ref: CheckpointRef) -> tuple[list[int], list[int]]:
    """The shards and the bucket map a checkpoint was written with (from its manifest)."""
    manifest = read_manifest(ref)
    return sorted(int(i) for i in manifest["shards"]), list(manifest["bucket_map"])
