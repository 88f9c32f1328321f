"""`StoragePath`: a file or directory in a store, with the part of `pathlib.Path`'s API psrec uses.

``location("runs/x")`` is a `pathlib.Path`; ``location("s3://bucket/runs/x")`` is a `StoragePath`, so
code that builds names (``/``, ``name``, ``parent``), lists (``iterdir``), checks (``exists``,
``is_dir``, ``stat().st_size``) and reads or writes whole files works on both. A `StoragePath` holds
only its URI: it pickles to another process (a Ray shard actor), which resolves the file system
itself from its own environment, so no bytes and no credentials travel through the driver.

Object stores have no directories and no rename: ``mkdir`` is a no-op there, a "directory" exists
while objects lie under its prefix, and one object appears whole when its upload completes, never
half-written. Every failing store call raises `StorageError` (an `OSError`) naming the URI, or
`FileNotFoundError` for a missing object.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from psrec.storage.filesystems import StorageError, check_uri, filesystem, is_uri, local_path


@dataclass(frozen=True)
class Stat:
    st_size: int


class StoragePath:
    """A path in a store, named by its URI (``s3://bucket/run/checkpoints``); see the module docstring."""

    __slots__ = ("uri",)

    def __init__(self, uri: str) -> None:
        check_uri(uri)
        scheme, rest = uri.split("://", 1)
        stripped = rest.rstrip("/")
        object.__setattr__(self, "uri", f"{scheme.lower()}://{stripped}")

    uri: str

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StoragePath is immutable")

    def __reduce__(self) -> tuple[type[StoragePath], tuple[str]]:
        return StoragePath, (self.uri,)

    def __repr__(self) -> str:
        return f"StoragePath({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoragePath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __lt__(self, other: StoragePath) -> bool:
        return self.uri < other.uri

    def __truediv__(self, name: str) -> StoragePath:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"{self.uri}: {name!r} is not a relative name")
        return StoragePath(f"{self.uri}/{name}")

    # -- names -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        rest = self.uri.split("://", 1)[1]
        return rest.rsplit("/", 1)[1] if "/" in rest else ""

    @property
    def parent(self) -> StoragePath:
        scheme, rest = self.uri.split("://", 1)
        return StoragePath(f"{scheme}://{rest.rsplit('/', 1)[0]}") if "/" in rest else self

    def with_name(self, name: str) -> StoragePath:
        return self.parent / name

    @property
    def is_bucket_root(self) -> bool:
        """True for ``s3://bucket`` itself (no path inside the bucket)."""
        return "/" not in self.uri.split("://", 1)[1]

    def _resolve(self) -> tuple[pafs.FileSystem, str]:
        return filesystem(self.uri)

    def _fail(self, action: str, error: Exception) -> StorageError:
        return StorageError(f"{self.uri}: cannot {action}: {_short(error)}")

    # -- queries ---------------------------------------------------------------------------------
    def _info(self) -> pafs.FileInfo:
        fs, path = self._resolve()
        try:
            return fs.get_file_info(path)
        except (OSError, pa.ArrowException) as error:
            raise self._fail("look it up", error) from None

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def stat(self) -> Stat:
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{self.uri} does not exist")
        return Stat(st_size=int(info.size or 0))

    def iterdir(self) -> Iterator[StoragePath]:
        """The entries directly under this directory (none when it does not exist)."""
        fs, path = self._resolve()
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
        except (OSError, pa.ArrowException) as error:
            raise self._fail("list it", error) from None
        for info in sorted(infos, key=lambda i: i.path):
            yield self / info.base_name

    def glob_files(self, pattern: str) -> list[StoragePath]:
        """Files directly under this directory whose names match the shell pattern, sorted."""
        import fnmatch

        fs, path = self._resolve()
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
        except (OSError, pa.ArrowException) as error:
            raise self._fail("list it", error) from None
        names = [i.base_name for i in infos if i.type == pafs.FileType.File]
        return [self / name for name in sorted(names) if fnmatch.fnmatchcase(name, pattern)]

    # -- reading ---------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        fs, path = self._resolve()
        try:
            with fs.open_input_stream(path) as stream:
                return bytes(stream.read())
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri} does not exist") from None
        except (OSError, pa.ArrowException) as error:
            if "not exist" in str(error) or "NoSuchKey" in str(error) or "not found" in str(error):
                raise FileNotFoundError(f"{self.uri} does not exist") from None
            raise self._fail("read it", error) from None

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def read_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """The file's bytes in chunks (streamed, for hashing large files)."""
        fs, path = self._resolve()
        try:
            with fs.open_input_stream(path) as stream:
                while chunk := stream.read(chunk_bytes):
                    yield bytes(chunk)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri} does not exist") from None
        except (OSError, pa.ArrowException) as error:
            raise self._fail("read it", error) from None

    def open_input_file(self) -> Any:
        """A random-access pyarrow file (for Parquet)."""
        fs, path = self._resolve()
        try:
            return fs.open_input_file(path)
        except (OSError, pa.ArrowException) as error:
            raise self._fail("open it", error) from None

    # -- writing ---------------------------------------------------------------------------------
    def write_bytes(self, data: bytes) -> int:
        """Upload ``data`` as this object (visible whole when the upload completes)."""
        fs, path = self._resolve()
        try:
            with fs.open_output_stream(path) as stream:
                stream.write(data)
        except (OSError, pa.ArrowException) as error:
            raise self._fail("write it", error) from None
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Create the directory (a marker where the store has directories; object stores need none)."""
        fs, path = self._resolve()
        if self.uri.startswith(("s3://", "gs://", "gcs://")):
            return  # prefixes need no creating; a bucket is never created here
        try:
            fs.create_dir(path, recursive=parents)
        except (OSError, pa.ArrowException) as error:
            raise self._fail("create it", error) from None

    def unlink(self, missing_ok: bool = False) -> None:
        fs, path = self._resolve()
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        except (OSError, pa.ArrowException) as error:
            if missing_ok and not self.exists():
                return
            raise self._fail("delete it", error) from None

    def rmtree(self) -> None:
        """Delete this directory and everything under it (nothing when it does not exist)."""
        fs, path = self._resolve()
        try:
            if fs.get_file_info(path).type == pafs.FileType.NotFound:
                return
            fs.delete_dir(path)
        except (OSError, pa.ArrowException) as error:
            raise self._fail("delete it", error) from None


Location = Path | StoragePath


def location(where: str | os.PathLike[str] | StoragePath) -> Location:
    """A `StoragePath` for a store URI, a `Path` for a local path or ``file://`` URI."""
    if isinstance(where, StoragePath | Path):
        return where
    return StoragePath(os.fspath(where)) if is_uri(where) else local_path(where)


def copy_tree(source: Path, target: Location) -> int:
    """Copy the local directory ``source`` (files, recursively) to ``target``; returns files copied."""
    copied = 0
    for path in sorted(source.rglob("*")):
        if path.is_file():
            destination: Location = target
            for part in path.relative_to(source).parts:
                destination = destination / part
            if isinstance(destination, Path):
                destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(path.read_bytes())
            copied += 1
    return copied


def _short(error: Exception) -> str:
    """The first line of a store error, without the SDK's noise."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]
