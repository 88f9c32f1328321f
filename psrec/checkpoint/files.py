"""Crash-safe file primitives for checkpoints: atomic writes, fsync, checksums, safe formats.

The rest of `psrec.checkpoint` decides what goes into a checkpoint; this module only knows how to put bytes
on disk so that a process killed at any instant leaves either the old file, or no file, or the complete new
file, never a half-written one under the final name:

1. write to a temporary name in the same directory, flush, ``fsync`` the file;
2. ``rename`` it onto the final name (atomic within one file system);
3. ``fsync`` the directory so that the rename itself survives a power loss.

On an object store (a `psrec.storage.StoragePath`) there is no rename and none is needed: an object
appears whole when its upload completes, so a file is built in memory and uploaded under its final
name; a torn upload is caught by the size and sha256 the manifest records.

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
import threading
import uuid
import zipfile
from collections.abc import Callable, Mapping
from typing import IO, Any

import numpy as np

from psrec.storage import Location, StoragePath

TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


def fsync_directory(path: Location) -> None:
    """Make renames and creations inside ``path`` durable (nothing to do on an object store)."""
    if isinstance(path, StoragePath):
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """A unique temporary sibling name for ``name`` (recognisable by `TEMP_PREFIX`)."""
    return f"{TEMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def discard_directory(path: Location, *, commit_marker: str = "manifest.json") -> None:
    """Remove ``path`` atomically first (rename to a `TRASH_PREFIX` name), then delete its files.

    On an object store (no rename) its ``commit_marker`` goes first, so readers stop listing it as
    committed before any of its other files disappear.
    """
    if isinstance(path, StoragePath):
        (path / commit_marker).unlink(missing_ok=True)
        path.rmtree()
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_directory(path.parent)
    shutil.rmtree(trash)


def atomic_write(
    path: Location, write: Callable[[IO[bytes]], object], *, sync_directory: bool = True
) -> tuple[str, int] | None:
    """Write ``path`` through ``write(file)`` atomically: temp name, flush, fsync, rename, fsync dir.

    ``sync_directory=False`` skips the directory fsync, for a caller that fsyncs the directory once
    after writing several files into it. On an object store the bytes are built in memory and
    uploaded under the final name; their (sha256, size) is returned, so that the caller need not
    read the object back (None for a local file).
    """
    if isinstance(path, StoragePath):
        buffer = io.BytesIO()
        write(buffer)
        data = buffer.getvalue()
        path.write_bytes(data)
        return hashlib.sha256(data).hexdigest(), len(data)
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
    return None


def atomic_write_bytes(path: Location, data: bytes, *, sync_directory: bool = True) -> tuple[str, int] | None:
    return atomic_write(path, lambda file: file.write(data), sync_directory=sync_directory)


def record_of(path: Location, written: tuple[str, int] | None) -> tuple[str, int]:
    """(sha256, size) of a file just written: what the upload reported, or read back from disk."""
    if written is not None:
        size = path.stat().st_size  # the store's own account of the object
        if size != written[1]:
            raise OSError(f"{path}: {size} bytes stored, {written[1]} uploaded")
        return written
    return sha256_of_file(path), path.stat().st_size


def sha256_of_file(path: Location) -> str:
    digest = hashlib.sha256()
    if isinstance(path, StoragePath):
        for chunk in path.read_chunks(_HASH_CHUNK_BYTES):
            digest.update(chunk)
        return digest.hexdigest()
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


def write_json(path: Location, value: Any, *, sync_directory: bool = True) -> tuple[str, int] | None:
    data = json.dumps(value, sort_keys=True, indent=1).encode("utf-8")
    return atomic_write_bytes(path, data, sync_directory=sync_directory)


def read_json(path: Location) -> Any:
    if isinstance(path, StoragePath):
        return json.loads(path.read_bytes().decode("utf-8"))
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def write_arrays(
    path: Location, arrays: Mapping[str, np.ndarray], *, sync_directory: bool = True
) -> tuple[str, int] | None:
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

    return atomic_write(path, write, sync_directory=sync_directory)


# NumPy parses every .npy header with `ast.literal_eval`, and CPython 3.11 builds AST objects with
# interpreter-wide state: two threads doing it at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905). Checkpoints are read in threads (one per file),
# so their members are decoded one at a time; the bytes of a stored file are fetched before that.
_DECODE_LOCK = threading.Lock()


def read_npz(source: str | os.PathLike[str] | IO[bytes]) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` (no pickle), safe to call from several threads at once."""
    with np.load(source, allow_pickle=False) as archive:
        arrays = {}
        for name in archive.files:
            with _DECODE_LOCK:
                arrays[name] = archive[name]
        return arrays


def read_arrays(path: Location) -> dict[str, np.ndarray]:
    return read_npz(io.BytesIO(path.read_bytes()) if isinstance(path, StoragePath) else path)


def torch_state_bytes(state: Mapping[str, Any]) -> bytes:
    """A (nested) state dict of tensors and plain values as `torch.save` writes it, checked to load
    back with ``weights_only`` (TypeError otherwise). A trainer serialises its own dense state with
    it, so that the driver writes the checkpoint without importing torch."""
    import torch  # shard processes never write dense state and start without torch

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
    return buffer.getvalue()


def write_torch_state(
    path: Location, state: Mapping[str, Any] | bytes, *, sync_directory: bool = True
) -> tuple[str, int] | None:
    """Store a (nested) state dict of tensors and plain values, or its `torch_state_bytes`; see
    `read_torch_state`."""
    data = state if isinstance(state, bytes) else torch_state_bytes(state)
    return atomic_write_bytes(path, data, sync_directory=sync_directory)


def read_torch_state(path: Location) -> dict[str, Any]:
    import torch

    source = io.BytesIO(path.read_bytes()) if isinstance(path, StoragePath) else path
    return torch.load(source, map_location="cpu", weights_only=True)
