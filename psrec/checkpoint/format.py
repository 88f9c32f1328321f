"""The on-disk format of a checkpoint: names, version, the data it holds, and its errors.

A checkpoint is one directory under ``RUN_DIR/checkpoints/``::

    ckpt-000001200-full/           ckpt-{step:09d}-{full|delta}
      shard-0.npz ... shard-N.npz  one flat {name: array} dict per parameter-server shard ("table/field")
      dense.pt                     dense model + optimizer state (torch.save, read with weights_only=True)
      trainers.json                {"trainers": [per-trainer reader position, ...], "extra": {...}}
      manifest.json                written LAST: the commit marker (`psrec.checkpoint.manifest`)

``RUN_DIR`` is a local path or a store URI (`psrec.storage`). On an object store, which cannot rename a
directory, each checkpoint is written straight into a directory of its own unique name,
``ckpt-{step:09d}-{kind}.{8 hex digits}``; the manifest, written last, still commits it.

A delta's shard files hold only the rows changed or removed since its parent; its dense state, trainer
positions and ``extra`` are whole. Every file is a safe format: nothing is ever unpickled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psrec.checkpoint.policy import Kind
from psrec.storage import Location, StoragePath, location

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.pt"
TRAINERS_FILE = "trainers.json"
NAME_PATTERN = re.compile(r"^ckpt-(\d{9})-(full|delta)(\.[0-9a-f]{8})?$")
MAX_STEP = 10**9 - 1


class CheckpointError(Exception):
    """A checkpoint is missing, torn, corrupt, or cannot be used; the message says which and why."""


class ConfigMismatchError(CheckpointError):
    """A checkpoint was written with a different config; ``fields`` lists the differing dotted paths."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass
class CheckpointData:
    """What one checkpoint holds. For a delta, ``shards`` holds only the changed/removed rows."""

    step: int
    shards: dict[int, dict[str, np.ndarray]]
    dense: dict[str, Any] = field(default_factory=dict)  # tensors / nested state dicts (weights_only-safe)
    trainers: list[dict[str, Any]] = field(default_factory=list)  # JSON-able, one entry per trainer
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-able


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: a temporary directory nobody lists (on an object store: its final,
    unique directory, which nobody loads before its manifest is there). Picklable, so shard
    processes that reach the same storage can each `write_shard` into it while the coordinator later
    commits it.
    """

    run_dir: Location
    step: int
    kind: Kind
    directory: Location
    started: float  # unix seconds


@dataclass(frozen=True)
class FileRecord:
    """What a writer reports of one file it wrote: the manifest records it and readers check it."""

    sha256: str
    size: int


def checkpoint_name(step: int, kind: Kind) -> str:
    return f"ckpt-{step:09d}-{kind}"


def shard_file(shard_id: int) -> str:
    return f"shard-{shard_id}.npz"


def checkpoints_root(run_dir: str | os.PathLike[str] | StoragePath) -> Location:
    return location(run_dir) / CHECKPOINTS_DIR
