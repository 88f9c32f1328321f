"""Checkpoints on disk: atomic full and incremental (delta) checkpoints, verification, restore, retention.

A checkpoint is one directory under ``RUN_DIR/checkpoints/``::

    ckpt-000001200-full/           ckpt-{step:09d}-{full|delta}
      shard-0.npz ... shard-N.npz  one flat {name: array} dict per parameter-server shard ("table/field")
      dense.pt                     dense model + optimizer state (torch.save, read with weights_only=True)
      trainers.json                {"trainers": [per-trainer reader position, ...], "extra": {...}}
      manifest.json                written LAST: the commit marker (see `save_checkpoint`)

The manifest holds the format version, step, kind, a unique checkpoint id, ``base`` (the full checkpoint
a delta chain starts from) and ``parent`` (the previous checkpoint of the chain), the creation time, the
config and its fingerprint (sha256 of its canonical JSON), the caller's shard/bucket map, and the sha256
and size of every other file (their sum and ``write_seconds`` give the full-vs-delta size and time), plus
a checksum of the manifest itself.

Shards can write their own files in parallel: `begin_checkpoint` makes the temporary directory, each
shard process calls `write_shard` into it, and the coordinator calls `commit_checkpoint` with the returned
`FileRecord`s; `save_checkpoint` does all three in one process.

Crash safety: every file is written to a temporary name, fsynced and renamed; the directory is built under
a temporary name (``.tmp-...``), fsynced and renamed into place; then the manifest is written. A process
killed at any instant therefore leaves a temporary directory, or a directory without a manifest, neither
of which is ever listed or loaded. Files never unpickle (``allow_pickle=False``, ``weights_only=True``).

Restoring = load the full checkpoint, then apply each delta's shard files in order; dense state, trainer
positions and ``extra`` come from the last checkpoint of the chain (every delta stores them whole). A
restarted shard reads only its own file of each checkpoint: ``load_checkpoint(ref, shards=[i], dense=False)``.
`resolve_restore_chain` picks the newest chain whose every file verifies, warns about each checkpoint it
skips and why, and refuses a chain written with a different config (`ConfigMismatchError`).

The decisions (which chain to restore, what retention deletes, how configs differ) are pure functions
over `CheckpointRef`s in `psrec.train.checkpoint_policy`, tested without a file system. Saving, retention and other
writers must not run concurrently on the same run directory; readers may.

Tests: ``python -m pytest tests/train/test_checkpoint.py tests/train/test_checkpoint_policy.py -q``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from psrec.train import checkpoint_io as io
from psrec.train.checkpoint_policy import (
    CheckpointRef,
    Kind,
    checkpoint_order,
    choose_restore_chain,
    choose_retention,
    config_differences,
    diff_configs,
    show_value,
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

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.pt"
TRAINERS_FILE = "trainers.json"
_TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^ckpt-(\d{9})-(full|delta)$")
_MAX_STEP = 10**9 - 1


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


def checkpoint_name(step: int, kind: Kind) -> str:
    return f"ckpt-{step:09d}-{kind}"


def shard_file(shard_id: int) -> str:
    return f"shard-{shard_id}.npz"


# ------------------------------------------------------------------------------------------- saving


def save_checkpoint(
    run_dir: str | os.PathLike[str],
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


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: a temporary directory nobody lists. Picklable, so shard processes on
    the same file system can each `write_shard` into it while the coordinator later commits it.
    """

    run_dir: Path
    step: int
    kind: Kind
    directory: Path
    started: float  # unix seconds


@dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int


def begin_checkpoint(run_dir: str | os.PathLike[str], *, step: int, kind: Kind) -> PendingCheckpoint:
    """Create the temporary directory of a new checkpoint (step between 0 and 999,999,999)."""
    if kind not in ("full", "delta"):
        raise ValueError(f"kind must be 'full' or 'delta', got {kind!r}")
    if not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be an int in [0, {_MAX_STEP}], got {step!r}")
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        io.fsync_directory(root.parent)
    directory = root / io.temp_name(checkpoint_name(step, kind))
    directory.mkdir()
    return PendingCheckpoint(Path(run_dir), step, kind, directory, time.time())


def write_shard(pending: PendingCheckpoint, shard_id: int, arrays: dict[str, np.ndarray]) -> FileRecord:
    """Write one shard's flat ``{"table/field": array}`` dict into ``pending``; pass the returned record
    to `commit_checkpoint`. Safe to call concurrently for different shards, from different processes.
    """
    if not isinstance(shard_id, int) or shard_id < 0:
        raise ValueError(f"shard ids must be non-negative ints, got {shard_id!r}")
    path = pending.directory / shard_file(shard_id)
    io.write_arrays(path, arrays, sync_directory=False)  # commit_checkpoint fsyncs the directory
    return FileRecord(sha256=io.sha256_of_file(path), size=path.stat().st_size)


def abort_checkpoint(pending: PendingCheckpoint) -> None:
    """Throw away an uncommitted checkpoint (retention would also remove it later)."""
    shutil.rmtree(pending.directory, ignore_errors=True)


def commit_checkpoint(
    pending: PendingCheckpoint,
    *,
    shard_files: dict[int, FileRecord],
    dense: dict[str, Any],
    trainers: list[dict[str, Any]],
    extra: dict[str, Any],
    config: dict[str, Any],
    bucket_map: Any,
    parent: CheckpointRef | None = None,
) -> CheckpointRef:
    """Write the dense and trainer state, move ``pending`` into place and write its manifest (the commit).

    ``shard_files`` must hold the record of every `write_shard` call; see `save_checkpoint` for the rest.
    """
    step, kind, temporary = pending.step, pending.kind, pending.directory
    parent_link, base_link = _check_commit_arguments(
        step, kind, parent, config, [bucket_map, trainers, extra]
    )
    written = {p.name for p in temporary.iterdir() if p.name.startswith("shard-")}
    if written != {shard_file(i) for i in shard_files}:
        raise CheckpointError(
            f"{temporary.name}: shard files {sorted(written)} do not match {sorted(shard_files)}"
        )
    files: dict[str, dict[str, Any]] = {}
    for shard_id, record in sorted(shard_files.items()):
        if (temporary / shard_file(shard_id)).stat().st_size != record.size:
            raise CheckpointError(f"{temporary.name}: {shard_file(shard_id)} does not have its recorded size")
        files[shard_file(shard_id)] = {"sha256": record.sha256, "size": record.size}
    io.write_torch_state(temporary / DENSE_FILE, dense, sync_directory=False)
    io.write_json(temporary / TRAINERS_FILE, {"trainers": trainers, "extra": extra}, sync_directory=False)
    for name in (DENSE_FILE, TRAINERS_FILE):
        files[name] = {
            "sha256": io.sha256_of_file(temporary / name),
            "size": (temporary / name).stat().st_size,
        }
    io.fsync_directory(temporary)  # makes the renames of all the files above durable

    name = checkpoint_name(step, kind)
    final = temporary.parent / name
    if final.exists():
        logger.warning("replacing existing checkpoint directory %s", final)
        _discard(final)
    os.rename(temporary, final)
    io.fsync_directory(final.parent)

    created = time.time()
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "checkpoint_id": uuid.uuid4().hex,
        "name": name,
        "step": step,
        "kind": kind,
        "base": base_link,
        "parent": parent_link,
        "created": created,
        "created_utc": datetime.fromtimestamp(created, UTC).isoformat(),
        "write_seconds": round(created - pending.started, 6),
        "config_fingerprint": io.fingerprint(config),
        "config": config,
        "bucket_map": bucket_map,
        "shards": sorted(shard_files),
        "files": files,
    }
    manifest["manifest_sha256"] = io.fingerprint(manifest)
    io.write_json(final / MANIFEST_FILE, manifest)
    total_bytes = sum(f["size"] for f in files.values())
    logger.info(
        "saved checkpoint %s (%d files, %.1f MiB) in %.3f s",
        final,
        len(files),
        total_bytes / 2**20,
        time.time() - pending.started,
    )
    return _ref_from_manifest(final, manifest)


def _check_commit_arguments(
    step: int, kind: Kind, parent: CheckpointRef | None, config: dict[str, Any], json_values: list[Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Fail before writing anything; return the manifest's parent and base links."""
    if (kind == "delta") != (parent is not None):
        raise ValueError("a delta checkpoint needs a parent and a full checkpoint takes none")
    io.fingerprint(config)  # TypeError if not JSON-able
    io.canonical_json(json_values)
    if parent is None:
        return None, None
    if parent.step >= step:
        raise ValueError(f"parent {parent.name} is not older than step {step}")
    parent_manifest = read_manifest(parent)  # raises if the parent is not committed
    parent_link = _link(parent)
    return parent_link, parent_link if parent.kind == "full" else parent_manifest["base"]


def _link(ref: CheckpointRef) -> dict[str, Any]:
    return {"id": ref.checkpoint_id, "name": ref.name, "step": ref.step}


def _discard(path: Path) -> None:
    """Uncommit ``path`` atomically (rename to a trash name), then delete it."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    io.fsync_directory(path.parent)
    shutil.rmtree(trash)


# ------------------------------------------------------------------------------------------ reading


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[CheckpointRef]:
    """Committed checkpoints (manifest present and intact), oldest first. Files are not verified."""
    return _scan(Path(run_dir))[0]


def _scan(run_dir: Path) -> tuple[list[CheckpointRef], list[tuple[Path, str]]]:
    """Committed refs, and the checkpoint-named directories that are not usable with the reason."""
    root = run_dir / CHECKPOINTS_DIR
    refs: list[CheckpointRef] = []
    broken: list[tuple[Path, str]] = []
    if not root.is_dir():
        return refs, broken
    for path in sorted(root.iterdir()):
        if not _NAME.match(path.name) or not path.is_dir():
            continue
        if not (path / MANIFEST_FILE).exists():
            broken.append((path, "it has no manifest.json (torn write: killed before it was committed)"))
            continue
        try:
            refs.append(_ref_from_manifest(path, _read_manifest_at(path)))
        except (CheckpointError, KeyError, TypeError) as error:
            broken.append((path, str(error).removeprefix(f"{path.name}: ")))
    return sorted(refs, key=checkpoint_order), broken


def read_manifest(ref: CheckpointRef) -> dict[str, Any]:
    """The checkpoint's manifest, checked for integrity and for belonging to ``ref``."""
    manifest = _read_manifest_at(ref.path)
    if manifest["checkpoint_id"] != ref.checkpoint_id:
        raise CheckpointError(f"{ref.name}: manifest.json was replaced since this checkpoint was listed")
    return manifest


def _read_manifest_at(path: Path) -> dict[str, Any]:
    where = f"{path.name}: manifest.json"
    try:
        manifest = io.read_json(path / MANIFEST_FILE)
    except FileNotFoundError:
        if not path.is_dir():
            raise CheckpointError(f"{path.name}: the checkpoint directory is gone ({path})") from None
        raise CheckpointError(
            f"{where} is missing (torn write: the checkpoint was never committed)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{where} is unreadable: {error}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where} is not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{where} has format version {version!r}; this psrec reads {FORMAT_VERSION}")
    claimed = manifest.pop("manifest_sha256", None)
    actual = io.fingerprint(manifest)
    if claimed != actual:
        raise CheckpointError(f"{where} is corrupt: checksum {actual} does not match recorded {claimed}")
    if manifest.get("name") != path.name:
        raise CheckpointError(f"{where} belongs to {manifest.get('name')!r}, not to this directory")
    return manifest


def _ref_from_manifest(path: Path, manifest: dict[str, Any]) -> CheckpointRef:
    parent, base = manifest.get("parent"), manifest.get("base")
    return CheckpointRef(
        path=path,
        step=manifest["step"],
        kind=manifest["kind"],
        checkpoint_id=manifest["checkpoint_id"],
        parent_id=parent["id"] if parent else None,
        base_id=base["id"] if base else None,
        created=manifest["created"],
    )


def _file_problem(ref: CheckpointRef, manifest: dict[str, Any], name: str, *, checksum: bool) -> str | None:
    expected = manifest["files"].get(name)
    if expected is None:
        return f"{name} is not listed in its manifest"
    path = ref.path / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    if size != expected["size"]:
        return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
    if checksum:
        actual = io.sha256_of_file(path)
        if actual != expected["sha256"]:
            return f"{name} is corrupt: sha256 {actual}, the manifest says {expected['sha256']}"
    return None


def _problem(ref: CheckpointRef, *, checksums: bool = True) -> str | None:
    try:
        manifest = read_manifest(ref)
    except CheckpointError as error:
        return str(error).removeprefix(f"{ref.name}: ")
    for name in [*(shard_file(s) for s in manifest["shards"]), DENSE_FILE, TRAINERS_FILE]:
        if problem := _file_problem(ref, manifest, name, checksum=checksums):
            return problem
    return None


def _cached_problems(*, checksums: bool) -> Callable[[CheckpointRef], str | None]:
    """`_problem` for the decisions, checking each checkpoint at most once."""
    problems: dict[str, str | None] = {}

    def problem_of(ref: CheckpointRef) -> str | None:
        if ref.checkpoint_id not in problems:
            problems[ref.checkpoint_id] = _problem(ref, checksums=checksums)
        return problems[ref.checkpoint_id]

    return problem_of


def verify(ref: CheckpointRef, *, checksums: bool = True) -> None:
    """Raise `CheckpointError` naming the first missing, truncated or corrupt file of ``ref``.

    ``checksums=False`` only checks presence and sizes (fast; does not read the files).
    """
    if problem := _problem(ref, checksums=checksums):
        raise CheckpointError(f"{ref.name}: {problem}")


def load_checkpoint(
    ref: CheckpointRef, *, shards: Collection[int] | None = None, dense: bool = True
) -> CheckpointData:
    """Verify and load ``ref``. ``shards`` restricts which shard files are read (a restarted shard needs
    only its own); ``dense=False`` skips the dense state. Only the files read are verified.
    """
    manifest = read_manifest(ref)
    wanted = sorted(manifest["shards"]) if shards is None else sorted(set(shards))
    absent = sorted(set(wanted) - set(manifest["shards"]))
    if absent:
        raise CheckpointError(f"{ref.name} has no shard(s) {absent}; it has {manifest['shards']}")
    names = [*(shard_file(s) for s in wanted), *([DENSE_FILE] if dense else []), TRAINERS_FILE]
    for name in names:
        if problem := _file_problem(ref, manifest, name, checksum=True):
            raise CheckpointError(f"{ref.name}: {problem}")
    small = io.read_json(ref.path / TRAINERS_FILE)
    return CheckpointData(
        step=manifest["step"],
        shards={s: io.read_arrays(ref.path / shard_file(s)) for s in wanted},
        dense=io.read_torch_state(ref.path / DENSE_FILE) if dense else {},
        trainers=small["trainers"],
        extra=small["extra"],
    )


def resolve_restore_chain(
    run_dir: str | os.PathLike[str],
    *,
    config: dict[str, Any],
    ignore_fields: Collection[str] = (),
    normalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    at_step: int | None = None,
) -> list[CheckpointRef]:
    """The chain to resume from, ``[full, delta1, ..., deltaN]``, or ``[]`` when there is none
    (with ``at_step``: the chain of the newest valid checkpoint of that step).

    Picks the newest checkpoint whose chain is complete and checksum-valid, logging a warning for each
    newer one it skips. Raises `ConfigMismatchError` if that chain was written with a config that
    differs from ``config`` outside ``ignore_fields`` (see `diff_configs`). ``normalize`` maps a saved
    config before the comparison (the trainer re-validates it, so that a field added to the schema
    since the checkpoint, at its default, is not a difference).
    """
    refs, broken = _scan(Path(run_dir))
    for path, reason in broken:
        logger.warning("skipping checkpoint %s: %s", path.name, reason)
    decision = choose_restore_chain(refs, _cached_problems(checksums=True), at_step=at_step)
    for ref, reason in decision.skipped:
        logger.warning("skipping checkpoint %s: %s", ref.name, reason)
    if not decision.chain:
        if refs or broken:
            logger.warning("no restorable checkpoint in %s", Path(run_dir) / CHECKPOINTS_DIR)
        return []
    for ref in decision.chain:
        saved = read_manifest(ref)["config"]
        if normalize is not None:  # e.g. fill fields added since the checkpoint with their defaults
            saved = normalize(saved)
        differences = config_differences(saved, config, ignore=ignore_fields)
        if differences:
            listed = "; ".join(
                f"{path}: {show_value(old)} -> {show_value(new)}" for path, old, new in differences
            )
            raise ConfigMismatchError(
                f"refusing to resume from {ref.path}: it was written with a different config "
                f"({len(differences)} field(s) differ, checkpoint -> current: {listed}). Resume with the "
                "original config, or start a new run directory.",
                [path for path, _, _ in differences],
            )
    logger.info("restoring from %s", " -> ".join(ref.name for ref in decision.chain))
    return decision.chain


# ---------------------------------------------------------------------------------------- retention


def apply_retention(
    run_dir: str | os.PathLike[str],
    *,
    keep_last: int,
    verify_checksums: bool = True,
    pinned_step: int | None = None,
) -> list[Path]:
    """Delete checkpoints older than the newest ``keep_last`` restorable chains (`choose_retention`),
    plus leftovers of torn writes (temporary directories, directories never committed), so never call
    it while a checkpoint is pending (between `begin_checkpoint` and its commit). Returns the deleted
    paths. Checksums are verified newest first until ``keep_last`` restorable chains are found (cost:
    reading those files); ``verify_checksums=False`` judges by file presence and size only.
    ``pinned_step`` keeps the chain of that step's newest checkpoint too (the best model).
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    refs, broken = _scan(Path(run_dir))
    problem_of = _cached_problems(checksums=verify_checksums)
    decision = choose_retention(refs, keep_last=keep_last, problem_of=problem_of, pinned_step=pinned_step)
    doomed = [ref.path for ref in decision.delete]
    for path, _ in broken:
        step = int(path.name.split("-")[1])
        uncommitted = not (path / MANIFEST_FILE).exists()
        if uncommitted or (decision.keep_from_step is not None and step < decision.keep_from_step):
            doomed.append(path)
    deleted: list[Path] = []
    # Newest first: if this is interrupted, what is left is still complete chains.
    for path in sorted(doomed, key=lambda p: p.name, reverse=True):
        _discard(path)
        deleted.append(path)
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.name.startswith((io.TEMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                deleted.append(path)
    if deleted:
        logger.info("retention (keep_last=%d) deleted %s", keep_last, ", ".join(p.name for p in deleted))
    return deleted
