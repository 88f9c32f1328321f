"""Writing checkpoints atomically: one process (`save_checkpoint`) or shards in parallel.

Shards write their own files in parallel: `begin_checkpoint` makes the temporary directory, each shard
process calls `write_shard` into it, and the coordinator calls `commit_checkpoint` with the returned
`FileRecord`s; `save_checkpoint` does all three in one process.

Crash safety: every file is written to a temporary name, fsynced and renamed; the directory is built under
a temporary name (``.tmp-...``), fsynced and renamed into place; then the manifest is written. A process
killed at any instant therefore leaves a temporary directory, or a directory without a manifest, neither
of which is ever listed or loaded. Saving, retention and other writers must not run concurrently on the
same run directory; readers may.

On an object store (``RUN_DIR`` an ``s3://``... URI) nothing is renamed: the checkpoint's directory gets
a unique final name (``ckpt-000000100-full.1a2b3c4d``), every file is uploaded once under its final
name, the manifest is the last upload and the commit, and a checkpoint of the same step and kind
that this one replaces is deleted only after the commit (manifest first).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from typing import Any

import numpy as np

from psrec.checkpoint import files
from psrec.checkpoint.format import (
    DENSE_FILE,
    MANIFEST_FILE,
    MAX_STEP,
    TRAINERS_FILE,
    CheckpointData,
    CheckpointError,
    FileRecord,
    PendingCheckpoint,
    checkpoint_name,
    checkpoints_root,
    shard_file,
)
from psrec.checkpoint.manifest import build_manifest, chain_links, ref_from_manifest, scan
from psrec.checkpoint.policy import CheckpointRef, Kind
from psrec.storage import Location, StorageError, StoragePath, location

logger = logging.getLogger(__name__)


def save_checkpoint(
    run_dir: str | os.PathLike[str] | StoragePath,
    data: CheckpointData,
    *,
    config: dict[str, Any],
    kind: Kind,
    bucket_map: Any,
    parent: CheckpointRef | None = None,
) -> CheckpointRef:
    """Write ``data`` as a committed checkpoint and return its ref.

    ``kind="delta"`` needs ``parent`` (the previous checkpoint of the chain, full or delta); ``"full"``
    takes none. ``config`` and ``bucket_map`` must be JSON-able; ``bucket_map`` is stored opaquely.
    An existing checkpoint with the same step and kind (left by a run that resumed from an older one)
    is replaced. This is `begin_checkpoint` + `write_shard` per shard + `commit_checkpoint` in one process.
    """
    _check_commit_arguments(data.step, kind, parent, config, [bucket_map, data.trainers, data.extra])
    pending = begin_checkpoint(run_dir, step=data.step, kind=kind)
    try:
        shard_files = {i: write_shard(pending, i, arrays) for i, arrays in sorted(data.shards.items())}
        return commit_checkpoint(
            pending,
            shard_files=shard_files,
            dense=data.dense,
            trainers=data.trainers,
            extra=data.extra,
            config=config,
            bucket_map=bucket_map,
            parent=parent,
        )
    except BaseException:
        abort_checkpoint(pending)
        raise


def begin_checkpoint(
    run_dir: str | os.PathLike[str] | StoragePath, *, step: int, kind: Kind
) -> PendingCheckpoint:
    """Create the temporary directory of a new checkpoint (step between 0 and 999,999,999); on an
    object store, name its unique final directory (created by its first file)."""
    if kind not in ("full", "delta"):
        raise ValueError(f"kind must be 'full' or 'delta', got {kind!r}")
    if not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    root = checkpoints_root(run_dir)
    if isinstance(root, StoragePath):
        directory = root / f"{checkpoint_name(step, kind)}.{uuid.uuid4().hex[:8]}"
        return PendingCheckpoint(location(run_dir), step, kind, directory, time.time())
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        files.fsync_directory(root.parent)
    local = root / files.temp_name(checkpoint_name(step, kind))
    local.mkdir()
    return PendingCheckpoint(location(run_dir), step, kind, local, time.time())


def write_shard(pending: PendingCheckpoint, shard_id: int, arrays: dict[str, np.ndarray]) -> FileRecord:
    """Write one shard's flat ``{"table/field": array}`` dict into ``pending``; pass the returned record
    to `commit_checkpoint`. Safe to call concurrently for different shards, from different processes.
    """
    if not isinstance(shard_id, int) or shard_id < 0:
        raise ValueError(f"shard ids must be non-negative ints, got {shard_id!r}")
    path = pending.directory / shard_file(shard_id)
    try:
        written = files.write_arrays(path, arrays, sync_directory=False)  # commit fsyncs the directory
        sha256, size = files.record_of(path, written)
    except StorageError as error:
        raise CheckpointError(
            f"{pending.directory.name}: cannot write {shard_file(shard_id)}: {error}"
        ) from None
    return FileRecord(sha256=sha256, size=size)


def abort_checkpoint(pending: PendingCheckpoint) -> None:
    """Throw away an uncommitted checkpoint (retention would also remove it later)."""
    if isinstance(pending.directory, StoragePath):
        try:
            pending.directory.rmtree()
        except StorageError as error:
            logger.warning("could not delete the aborted checkpoint %s: %s", pending.directory, error)
        return
    shutil.rmtree(pending.directory, ignore_errors=True)


def commit_checkpoint(
    pending: PendingCheckpoint,
    *,
    shard_files: dict[int, FileRecord],
    dense: dict[str, Any] | bytes,
    trainers: list[dict[str, Any]],
    extra: dict[str, Any],
    config: dict[str, Any],
    bucket_map: Any,
    parent: CheckpointRef | None = None,
) -> CheckpointRef:
    """Write the dense and trainer state, move ``pending`` into place and write its manifest (the commit).

    ``shard_files`` must hold the record of every `write_shard` call; ``dense`` is the state dict or
    its `files.torch_state_bytes` (a trainer's own, serialised where torch is); see
    `save_checkpoint` for the rest.
    """
    try:
        return _commit(
            pending,
            shard_files=shard_files,
            dense=dense,
            trainers=trainers,
            extra=extra,
            config=config,
            bucket_map=bucket_map,
            parent=parent,
        )
    except StorageError as error:
        raise CheckpointError(f"cannot commit checkpoint {pending.directory}: {error}") from None


def _commit(
    pending: PendingCheckpoint,
    *,
    shard_files: dict[int, FileRecord],
    dense: dict[str, Any] | bytes,
    trainers: list[dict[str, Any]],
    extra: dict[str, Any],
    config: dict[str, Any],
    bucket_map: Any,
    parent: CheckpointRef | None,
) -> CheckpointRef:
    temporary = pending.directory
    links = _check_commit_arguments(pending.step, pending.kind, parent, config, [bucket_map, trainers, extra])
    written = {p.name for p in temporary.iterdir() if p.name.startswith("shard-")}
    if written != {shard_file(i) for i in shard_files}:
        raise CheckpointError(
            f"{temporary.name}: shard files {sorted(written)} do not match {sorted(shard_files)}"
        )
    records: dict[str, dict[str, Any]] = {}
    for shard_id, record in sorted(shard_files.items()):
        if (temporary / shard_file(shard_id)).stat().st_size != record.size:
            raise CheckpointError(f"{temporary.name}: {shard_file(shard_id)} does not have its recorded size")
        records[shard_file(shard_id)] = {"sha256": record.sha256, "size": record.size}
    uploads = {
        DENSE_FILE: files.write_torch_state(temporary / DENSE_FILE, dense, sync_directory=False),
        TRAINERS_FILE: files.write_json(
            temporary / TRAINERS_FILE, {"trainers": trainers, "extra": extra}, sync_directory=False
        ),
    }
    for name, upload in uploads.items():
        sha256, size = files.record_of(temporary / name, upload)
        records[name] = {"sha256": sha256, "size": size}
    files.fsync_directory(temporary)  # makes the renames of all the files above durable

    name = checkpoint_name(pending.step, pending.kind)
    final: Location
    replaced: list[Location] = []
    if isinstance(temporary, StoragePath):  # no rename: the directory already has its final name
        final = temporary
        name = final.name
        replaced = [
            ref.path
            for ref in scan(pending.run_dir)[0]
            if ref.step == pending.step and ref.kind == pending.kind and ref.path != final
        ]
    else:
        final = temporary.parent / name
        if final.exists():
            logger.warning("replacing existing checkpoint directory %s", final)
            files.discard_directory(final)
        os.rename(temporary, os.fspath(final))
        files.fsync_directory(final.parent)

    manifest = build_manifest(
        pending,
        name=name,
        links=links,
        config=config,
        bucket_map=bucket_map,
        shards=sorted(shard_files),
        file_records=records,
    )
    files.write_json(final / MANIFEST_FILE, manifest)
    for path in replaced:  # after the commit: there is always a committed checkpoint of this step
        logger.warning("replacing existing checkpoint %s by %s", path, final.name)
        files.discard_directory(path, commit_marker=MANIFEST_FILE)
    total_bytes = sum(f["size"] for f in records.values())
    logger.info(
        "saved checkpoint %s (%d files, %.1f MiB) in %.3f s",
        final,
        len(records),
        total_bytes / 2**20,
        time.time() - pending.started,
    )
    return ref_from_manifest(final, manifest)


def _check_commit_arguments(
    step: int, kind: Kind, parent: CheckpointRef | None, config: dict[str, Any], json_values: list[Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Fail before writing anything; return the manifest's parent and base links."""
    if (kind == "delta") != (parent is not None):
        raise ValueError("a delta checkpoint needs a parent and a full checkpoint takes none")
    files.fingerprint(config)  # TypeError if not JSON-able
    files.canonical_json(json_values)
    return chain_links(kind, step, parent)
