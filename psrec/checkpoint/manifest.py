"""The manifest: a checkpoint's commit marker, and listing the committed checkpoints of a run.

``manifest.json`` is the last file written into a checkpoint directory. It holds the format version,
step, kind, a unique checkpoint id, ``base`` (the full checkpoint a delta chain starts from) and
``parent`` (the previous checkpoint of the chain), the creation time, the config and its fingerprint
(sha256 of its canonical JSON), the caller's shard/bucket map, and the sha256 and size of every other
file (their sum and ``write_seconds`` give the full-vs-delta size and time), plus a checksum of the
manifest itself. A directory without an intact manifest is never listed or loaded.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from psrec.checkpoint import files
from psrec.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    NAME_PATTERN,
    CheckpointError,
    PendingCheckpoint,
    checkpoints_root,
)
from psrec.checkpoint.policy import CheckpointRef, Kind, checkpoint_order
from psrec.storage import Location, StorageError, StoragePath, location


def build_manifest(
    pending: PendingCheckpoint,
    *,
    name: str,
    links: tuple[dict[str, Any] | None, dict[str, Any] | None],
    config: dict[str, Any],
    bucket_map: Any,
    shards: list[int],
    file_records: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of ``pending`` (``links`` = its parent and base links), with its own checksum."""
    created = time.time()
    parent_link, base_link = links
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "checkpoint_id": uuid.uuid4().hex,
        "name": name,
        "step": pending.step,
        "kind": pending.kind,
        "base": base_link,
        "parent": parent_link,
        "created": created,
        "created_utc": datetime.fromtimestamp(created, UTC).isoformat(),
        "write_seconds": round(created - pending.started, 6),
        "config_fingerprint": files.fingerprint(config),
        "config": config,
        "bucket_map": bucket_map,
        "shards": shards,
        "files": file_records,
    }
    manifest["manifest_sha256"] = files.fingerprint(manifest)
    return manifest


def chain_links(
    kind: Kind, step: int, parent: CheckpointRef | None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The manifest's (parent, base) links of a new checkpoint; fails before anything is written."""
    if (kind == "delta") != (parent is not None):
        raise ValueError("a delta checkpoint needs a parent and a full checkpoint takes none")
    if parent is None:
        return None, None
    if parent.step >= step:
        raise ValueError(f"parent {parent.name} is not older than step {step}")
    parent_manifest = read_manifest(parent)  # raises if the parent is not committed
    parent_link = link(parent)
    return parent_link, parent_link if parent.kind == "full" else parent_manifest["base"]


def link(ref: CheckpointRef) -> dict[str, Any]:
    return {"id": ref.checkpoint_id, "name": ref.name, "step": ref.step}


def list_checkpoints(run_dir: str | os.PathLike[str] | StoragePath) -> list[CheckpointRef]:
    """Committed checkpoints (manifest present and intact), oldest first. Files are not verified."""
    return scan(location(run_dir))[0]


def scan(run_dir: Location) -> tuple[list[CheckpointRef], list[tuple[Location, str]]]:
    """Committed refs, and the checkpoint-named directories that are not usable with the reason.

    Raises `CheckpointError` naming the location when the store cannot be listed.
    """
    root = checkpoints_root(run_dir)
    refs: list[CheckpointRef] = []
    broken: list[tuple[Location, str]] = []
    try:
        if not root.is_dir():
            return refs, broken
        entries: list[Location] = list(root.iterdir())
        entries.sort(key=lambda entry: entry.name)
    except StorageError as error:
        raise CheckpointError(f"cannot list the checkpoints in {root}: {error}") from None
    for path in entries:
        if not NAME_PATTERN.match(path.name) or not path.is_dir():
            continue
        if not (path / MANIFEST_FILE).exists():
            broken.append((path, "it has no manifest.json (torn write: killed before it was committed)"))
            continue
        try:
            refs.append(ref_from_manifest(path, read_manifest_at(path)))
        except (CheckpointError, KeyError, TypeError) as error:
            broken.append((path, str(error).removeprefix(f"{path.name}: ")))
    return sorted(refs, key=checkpoint_order), broken


def read_manifest(ref: CheckpointRef) -> dict[str, Any]:
    """The checkpoint's manifest, checked for integrity and for belonging to ``ref``."""
    manifest = read_manifest_at(ref.path)
    if manifest["checkpoint_id"] != ref.checkpoint_id:
        raise CheckpointError(f"{ref.name}: manifest.json was replaced since this checkpoint was listed")
    return manifest


def read_manifest_at(path: Location) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked for version and integrity."""
    where = f"{path.name}: manifest.json"
    try:
        manifest = files.read_json(path / MANIFEST_FILE)
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
    actual = files.fingerprint(manifest)
    if claimed != actual:
        raise CheckpointError(f"{where} is corrupt: checksum {actual} does not match recorded {claimed}")
    if manifest.get("name") != path.name:
        raise CheckpointError(f"{where} belongs to {manifest.get('name')!r}, not to this directory")
    return manifest


def ref_from_manifest(path: Location, manifest: dict[str, Any]) -> CheckpointRef:
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
