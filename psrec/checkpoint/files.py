"""Crash-safe file primitives for checkpoints: atomic writes, fsync, checksums, safe formats.

The rest of `psrec.checkpoint` decides what goes into a checkpoint; this module only knows how to put bytes
on disk so that a process killed at any instant leaves either the old file, or no file, or the complete new
file, never a half-written one under the final name:

1. write to a temporary name in the same directory, flush, ``fsync`` the file;
2. ``rename`` it onto the final name (atomic within one file system);
3. ``fsync`` the directory so that the rename itself survives a power loss.

Formats never unpickle: arrays are NumPy ``.npz`` read with ``allow_pickle=False``; dense torch state is
``torch.save`` read back with ``torch.load(weights_only=True)``; small state is JSON.

Nothing here is psrec-specific; the tests live in ``tests/checkpoint/test_store.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


def fsync_directory(path: Path) -> None:
    """Make renames and creations inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """A unique temporary sibling name for ``name`` (recognisable by `TEMP_PREFIX`)."""
    return f"{TEMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def discard_directory(path: Path) -> None:
    """Remove ``path`` atomically first (rename to a `TRASH_PREFIX` name), then delete its files."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_directory(path.parent)
    shutil.rmtree(trash)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], *, sync_directory: bool = True) -> None:
    """Write ``path`` through ``write(file)`` atomically: temp name, flush, fsync, rename, fsync dir.

    ``sync_directory=False`` skips the directory fsync, for a caller that fsyncs the directory once
    after writing several files into it.
    """
    temporary = path.with_name(temp_name(path.name))
    try:
        with open(temporary, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if sync_directory:
        fsync_directory(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, sync_directory: bool = True) -> None:
    atomic_write(path, lambda file: file.write(data), sync_directory=sync_directory)


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal strings (and fingerprints)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(value: Any) -> str:
    """sha256 of the canonical JSON of ``value``; raises TypeError if ``value`` is not JSON-able."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def write_json(path: Path, value: Any, *, sync_directory: bool = True) -> None:
    data = json.dumps(value, sort_keys=True, indent=1).encode("utf-8")
    atomic_write_bytes(path, data, sync_directory=sync_directory)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray], *, sync_directory: bool = True) -> None:
    """Store a flat ``{name: array}`` dict as an uncompressed ``.npz`` (no object arrays: no pickle)."""
    for name, array in arrays.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"array names must be non-empty strings, got {name!r}")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name!r}: expected a numpy array, got {type(array).__name__}")
        if array.dtype.hasobject:
            raise TypeError(f"{name!r}: object arrays would need pickle; store plain numeric arrays")

    def write(file: IO[bytes]) -> None:
        # What np.savez does, without its keyword-argument names (an array called "file" is fine here).
        with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                with archive.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)

    atomic_write(path, write, sync_directory=sync_directory)


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def write_torch_state(path: Path, state: Mapping[str, Any], *, sync_directory: bool = True) -> None:
    """Store a (nested) state dict of tensors and plain values; see `read_torch_state`."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    # weights_only loading must accept it, or resume would fail long after the save "succeeded".
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        detail = next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
        raise TypeError(
            "dense state must hold only tensors and plain Python values (it is read back with "
            f"torch.load(weights_only=True)): {detail.split('. Please')[0]}"
        ) from None
    atomic_write_bytes(path, buffer.getvalue(), sync_directory=sync_directory)


def read_torch_state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
