"""The exported model directory: its files, its manifest, and writing and reading it safely.

``psrec export`` writes one directory (a local path or a store URI, `psrec.storage`)::

    MODEL_DIR/
      model.pt2              the dense model as a `torch.export` program (loads with torch alone)
      catalogue.pt2          next-item models (SASRec, HSTU) only: the same model scoring one shared
                             (N, D) candidate matrix
      tables/<table>.npz     per embedding table: sorted ids, rows at the export precision
                             (+ per-row scale and offset at int8); no optimizer state
      serving.json           model name and kind, feature schema (hashing namespaces, dense transforms),
                             feature -> table maps, table sources, precision, the checkpoint it came from
      manifest.json          written LAST: format version, model version, sha256 and size of every
                             other file, and a checksum of itself. A directory without an intact
                             manifest is not an export.

Writes follow the checkpoint rules (`psrec.checkpoint.files`): locally the directory is built under
a temporary sibling name, every file fsynced, renamed into place, and an export it replaces is
removed only after the rename; on an object store every file is uploaded under its final name and
the manifest, uploaded last, commits it. `read_model_dir` verifies every checksum before anything
is loaded; nothing is unpickled (arrays: ``allow_pickle=False``; programs: `torch.export.load`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from psrec.checkpoint import files
from psrec.storage import Location, StorageError, StoragePath, location

EXPORT_FORMAT = "psrec-export"
EXPORT_VERSION = 2  # 2: serving.json's kind "next_item" (SASRec and HSTU), formerly "sasrec"
MANIFEST_FILE = "manifest.json"
SERVING_FILE = "serving.json"
MODEL_FILE = "model.pt2"
CATALOGUE_FILE = "catalogue.pt2"
TABLES_DIR = "tables"
NEXT_ITEM = "next_item"  # serving.json's kind of the models that rank items after a history


class ExportError(Exception):
    """An export cannot be written or read; the message names the directory, the file and the fix."""


def table_file(name: str) -> str:
    return f"{TABLES_DIR}/{name}.npz"


@dataclass
class ExportContents:
    """Everything an export holds, in memory: programs as bytes, tables as arrays, serving.json."""

    serving: dict[str, Any]
    programs: dict[str, bytes]  # file name -> torch.export.save bytes
    tables: dict[str, dict[str, np.ndarray]]  # table -> arrays (`ServingTable.to_arrays`)


def program_bytes(program: torch.export.ExportedProgram) -> bytes:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def load_program(data: bytes, *, where: str) -> torch.nn.Module:
    try:
        return torch.export.load(io.BytesIO(data)).module()
    except Exception as error:  # torch raises many types for a damaged archive
        raise ExportError(f"{where}: not a loadable torch.export program ({error})") from None


def write_model_dir(out: str | os.PathLike[str] | StoragePath, contents: ExportContents) -> Location:
    """Write ``contents`` as a committed export at ``out`` (see the module docstring)."""
    final = location(out)
    _check_target(final)
    try:
        if isinstance(final, StoragePath):
            (final / MANIFEST_FILE).unlink(missing_ok=True)  # an export it replaces stops being one first
            _write_manifest(final, _write_files(final, contents), contents)
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        target = final.with_name(files.temp_name(final.name))
        target.mkdir()
        try:
            _write_manifest(target, _write_files(target, contents), contents)
            files.fsync_directory(target)
            replaced = None
            if final.exists():
                replaced = final.with_name(f"{files.TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
                os.rename(final, replaced)
            os.rename(target, final)
            files.fsync_directory(final.parent)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        return final
    except StorageError as error:
        raise ExportError(f"cannot write the export {final}: {error}") from None


def _write_manifest(target: Location, records: dict[str, dict[str, Any]], contents: ExportContents) -> None:
    manifest: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "version": contents.serving["version"],
        "files": records,
    }
    manifest["manifest_sha256"] = files.fingerprint(manifest)
    files.write_json(target / MANIFEST_FILE, manifest)


def _check_target(final: Location) -> None:
    """Refuse to replace anything that is not an export (a run directory, someone's files)."""
    try:
        if not final.exists():
            return
        if not final.is_dir():
            raise ExportError(f"--out {final} is a file; give a directory to write the export into")
        names = [entry.name for entry in final.iterdir()]
    except StorageError as error:
        raise ExportError(f"--out {final} cannot be read: {error}") from None
    if names and MANIFEST_FILE not in names:
        raise ExportError(
            f"--out {final} is a non-empty directory that is not a psrec export; "
            "give a new or empty directory, or an earlier export to replace"
        )
    if names:
        try:
            manifest = files.read_json(final / MANIFEST_FILE)
        except (OSError, ValueError, StorageError):
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
            raise ExportError(f"--out {final} holds a manifest.json that is not a psrec export's; refusing")


def _write_files(target: Location, contents: ExportContents) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}

    def record(name: str, written: tuple[str, int] | None) -> None:
        sha256, size = files.record_of(target / name, written)
        records[name] = {"sha256": sha256, "size": size}

    if not isinstance(target, StoragePath):
        (target / TABLES_DIR).mkdir()
    for name, data in contents.programs.items():
        record(name, files.atomic_write_bytes(target / name, data, sync_directory=False))
    for table, arrays in contents.tables.items():
        record(
            table_file(table), files.write_arrays(target / table_file(table), arrays, sync_directory=False)
        )
    if not isinstance(target, StoragePath):
        files.fsync_directory(target / TABLES_DIR)
    record(SERVING_FILE, files.write_json(target / SERVING_FILE, contents.serving, sync_directory=False))
    return records


def read_manifest(model_dir: Location) -> dict[str, Any]:
    """The export's manifest, checked for format and integrity."""
    where = f"{model_dir}/{MANIFEST_FILE}"
    try:
        manifest = files.read_json(model_dir / MANIFEST_FILE)
    except FileNotFoundError:
        raise ExportError(
            f"{model_dir} is not a psrec export (no {MANIFEST_FILE}: write one with `psrec export RUN_DIR "
            "--out MODEL_DIR`, or the export was interrupted before its commit)"
        ) from None
    except (OSError, ValueError, StorageError) as error:
        raise ExportError(f"{where} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{where} is not a psrec export manifest")
    if manifest.get("format_version") != EXPORT_VERSION:
        raise ExportError(
            f"{where} has format version {manifest.get('format_version')!r}; this psrec reads "
            f"{EXPORT_VERSION}: export the run again with this psrec"
        )
    claimed = manifest.pop("manifest_sha256", None)
    if claimed != files.fingerprint(manifest):
        raise ExportError(f"{where} is corrupt (its checksum does not match): export the run again")
    return manifest


def read_file_checked(model_dir: Location, manifest: dict[str, Any], name: str) -> bytes:
    """The bytes of one listed file, after checking its size and sha256 against the manifest."""
    record = manifest["files"].get(name)
    if record is None:
        raise ExportError(f"{model_dir}: {name} is not listed in its manifest")
    path = model_dir / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ExportError(f"{model_dir}: {name} is missing; export the run again") from None
    except (OSError, StorageError) as error:
        raise ExportError(f"{model_dir}: {name} is unreadable: {error}") from None
    if len(data) != record["size"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ExportError(
            f"{model_dir}: {name} is corrupt or truncated ({len(data)} bytes; the manifest says "
            f"{record['size']} and another sha256): export the run again"
        )
    return data


def read_model_dir(
    model_dir: str | os.PathLike[str] | StoragePath, *, skip_tables: frozenset[str] = frozenset()
) -> ExportContents:
    """Verify and read an export (every file's checksum first), without the tables ``skip_tables``
    (served elsewhere: `psrec.serve.sharded`)."""
    root = location(model_dir)
    manifest = read_manifest(root)
    skipped = {table_file(name) for name in skip_tables}
    names = sorted(name for name in manifest["files"] if name not in skipped)
    blobs = {name: read_file_checked(root, manifest, name) for name in names}
    serving = json.loads(blobs.pop(SERVING_FILE).decode("utf-8"))
    tables: dict[str, dict[str, np.ndarray]] = {}
    programs: dict[str, bytes] = {}
    for name, data in blobs.items():
        if name.startswith(f"{TABLES_DIR}/"):
            table = name.removeprefix(f"{TABLES_DIR}/").removesuffix(".npz")
            tables[table] = files.read_npz(io.BytesIO(data))
        else:
            programs[name] = data
    if serving.get("version") != manifest.get("version"):
        raise ExportError(f"{root}: {SERVING_FILE} and {MANIFEST_FILE} name different versions")
    return ExportContents(serving=serving, programs=programs, tables=tables)
