"""Reading checkpoints: verify their files, load them, and resolve the chain a run resumes from.

Restoring = load the full checkpoint, then apply each delta's shard files in order; dense state, trainer
positions and ``extra`` come from the last checkpoint of the chain (every delta stores them whole). A
restarted shard reads only its own file of each checkpoint: ``load_checkpoint(ref, shards=[i], dense=False)``.
`resolve_restore_chain` picks the newest chain whose every file verifies, warns about each checkpoint it
skips and why, and refuses a chain written with a different config (`ConfigMismatchError`). The choice
itself is `psrec.checkpoint.policy.choose_restore_chain`, a pure function.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from psrec.checkpoint import files
from psrec.checkpoint.format import (
    DENSE_FILE,
    TRAINERS_FILE,
    CheckpointData,
    CheckpointError,
    ConfigMismatchError,
    checkpoints_root,
    shard_file,
)
from psrec.checkpoint.manifest import read_manifest, scan
from psrec.checkpoint.policy import CheckpointRef, choose_restore_chain, config_differences, show_value
from psrec.storage import StorageError, StoragePath, location

# Files of a checkpoint read or verified at once (reads of a store wait on the network, not the CPU).
READ_THREADS = 8

logger = logging.getLogger(__name__)


def _file_problem(ref: CheckpointRef, manifest: dict[str, Any], name: str, *, checksum: bool) -> str | None:
    expected = manifest["files"].get(name)
    if expected is None:
        return f"{name} is not listed in its manifest"
    path = ref.path / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except StorageError as error:
        return f"{name} is unreadable: {error}"
    if size != expected["size"]:
        return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
    if checksum:
        try:
            actual = files.sha256_of_file(path)
        except FileNotFoundError:
            return f"{name} is missing"
        except StorageError as error:
            return f"{name} is unreadable: {error}"
        if actual != expected["sha256"]:
            return f"{name} is corrupt: sha256 {actual}, the manifest says {expected['sha256']}"
    return None


def _problem(ref: CheckpointRef, *, checksums: bool = True) -> str | None:
    try:
        manifest = read_manifest(ref)
    except CheckpointError as error:
        return str(error).removeprefix(f"{ref.name}: ")
    names = [*(shard_file(s) for s in manifest["shards"]), DENSE_FILE, TRAINERS_FILE]
    found = _in_parallel(lambda name: _file_problem(ref, manifest, name, checksum=checksums), names)
    return next((problem for problem in found if problem), None)


def _in_parallel(function: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[function(item) for item in items]``, several at once (file reads and checksums)."""
    if len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(items))) as pool:
        return list(pool.map(function, items))


def cached_problems(*, checksums: bool) -> Callable[[CheckpointRef], str | None]:
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
    for problem in _in_parallel(lambda name: _file_problem(ref, manifest, name, checksum=True), names):
        if problem:
            raise CheckpointError(f"{ref.name}: {problem}")
    try:
        small = files.read_json(ref.path / TRAINERS_FILE)
        arrays = _in_parallel(lambda s: files.read_arrays(ref.path / shard_file(s)), wanted)
        dense_state = files.read_torch_state(ref.path / DENSE_FILE) if dense else {}
    except (StorageError, FileNotFoundError) as error:
        raise CheckpointError(f"{ref.path}: {error}") from None
    return CheckpointData(
        step=manifest["step"],
        shards=dict(zip(wanted, arrays, strict=True)),
        dense=dense_state,
        trainers=small["trainers"],
        extra=small["extra"],
    )


def load_chain(ref_chain: list[CheckpointRef], *, shards: Collection[int]) -> list[CheckpointData]:
    """`load_checkpoint` of every checkpoint of a chain (shard files only), read in parallel."""
    return _in_parallel(lambda ref: load_checkpoint(ref, shards=shards, dense=False), ref_chain)


def resolve_restore_chain(
    run_dir: str | os.PathLike[str] | StoragePath,
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
    refs, broken = scan(location(run_dir))
    for path, reason in broken:
        logger.warning("skipping checkpoint %s: %s", path.name, reason)
    decision = choose_restore_chain(refs, cached_problems(checksums=True), at_step=at_step)
    for ref, reason in decision.skipped:
        logger.warning("skipping checkpoint %s: %s", ref.name, reason)
    if not decision.chain:
        if refs or broken:
            logger.warning("no restorable checkpoint in %s", checkpoints_root(run_dir))
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
