"""Checkpoints: atomic full and incremental (delta) checkpoints, verification, restore, retention.

One module per concern:

- `format`     the directory layout, format version, `CheckpointData`, errors
- `files`      crash-safe file primitives (atomic writes, fsync, checksums, safe formats)
- `manifest`   the commit marker, and listing a run's committed checkpoints
- `save`       writing a checkpoint, in one process or by shards in parallel
- `load`       verifying and loading, resolving the chain to resume from
- `retention`  deleting old checkpoints and torn writes
- `policy`     the pure decisions (restore chain, retention, restarts, config differences)

This package sits below the parameter server and the trainers: it knows arrays, state dicts and JSON, not
shards, trainers or configs. Tests: ``python -m pytest tests/checkpoint -q``.
"""

from psrec.checkpoint.format import (
    CheckpointData,
    CheckpointError,
    ConfigMismatchError,
    FileRecord,
    PendingCheckpoint,
)
from psrec.checkpoint.load import load_checkpoint, resolve_restore_chain, verify
from psrec.checkpoint.manifest import list_checkpoints, read_manifest
from psrec.checkpoint.policy import CheckpointRef, diff_configs
from psrec.checkpoint.retention import apply_retention
from psrec.checkpoint.save import (
    abort_checkpoint,
    begin_checkpoint,
    commit_checkpoint,
    save_checkpoint,
    write_shard,
)

__all__ = [
    "CheckpointData",
    "CheckpointError",
    "CheckpointRef",
    "ConfigMismatchError",
    "FileRecord",
    "PendingCheckpoint",
    "abort_checkpoint",
    "apply_retention",
    "begin_checkpoint",
    "commit_checkpoint",
    "diff_configs",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "resolve_restore_chain",
    "save_checkpoint",
    "verify",
    "write_shard",
]
