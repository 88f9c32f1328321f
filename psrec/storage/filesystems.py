"""From a URI to a file system: pyarrow.fs for local, s3://, gs:// and hdfs://, fsspec for the rest.

Credentials and endpoints come from the environment or the store's usual config files, never from
the URI or the run config:

- ``s3://BUCKET/PATH``: the AWS SDK's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` with ``~/.aws/credentials`` and ``~/.aws/config``, web
  identity, container or instance credentials); the region from ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``; an S3-compatible store (MinIO, Ceph) from ``AWS_ENDPOINT_URL_S3`` or
  ``AWS_ENDPOINT_URL`` (``http://host:port`` for a plain-HTTP endpoint);
- ``gs://BUCKET/PATH``: Google's default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud);
- ``hdfs://HOST:PORT/PATH``: libhdfs and the Hadoop configuration (``HADOOP_HOME``, ``CLASSPATH``);
- any other scheme fsspec knows (``memory://``, ``az://``, ...): fsspec's own configuration.

Every store call is bounded: S3 and GCS get connect and request time-outs and a bounded number of
attempts (``PSREC_STORAGE_CONNECT_TIMEOUT_S``, ``PSREC_STORAGE_REQUEST_TIMEOUT_S``,
``PSREC_STORAGE_ATTEMPTS``; tests shrink them). A URI carrying a user, a password or query options is
refused: it would put secrets into config.json and logs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs

PYARROW_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs"})
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_ATTEMPTS = 3
# Environment variables that choose an S3 file system's endpoint and credentials (hashed into the
# cache key, so a changed environment builds a new file system; their values are never logged).
_S3_ENVIRONMENT = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_EC2_METADATA_DISABLED",
)
_TIMEOUT_ENVIRONMENT = (
    "PSREC_STORAGE_CONNECT_TIMEOUT_S",
    "PSREC_STORAGE_REQUEST_TIMEOUT_S",
    "PSREC_STORAGE_ATTEMPTS",
)

_cache: dict[tuple[str, str, str], pafs.FileSystem] = {}
_lock = threading.Lock()


class StorageError(OSError):
    """A store could not be reached or used; the message names the URI and what to do."""


def scheme_of(location: str | os.PathLike[str]) -> str | None:
    """The URI scheme of ``location`` (``"s3"``), or None for a local path (``file://`` included)."""
    text = os.fspath(location)
    if "://" not in text:
        return None
    scheme = text.split("://", 1)[0].lower()
    if not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum() or len(scheme) < 2:
        return None  # "c://" on Windows, or not a scheme at all
    return None if scheme == "file" else scheme


def is_uri(location: str | os.PathLike[str]) -> bool:
    """True for a store URI (``s3://...``); False for a local path or a ``file://`` URI."""
    return scheme_of(location) is not None


def local_path(location: str | os.PathLike[str]) -> Path:
    """A local path or ``file://`` URI as a `Path`."""
    text = os.fspath(location)
    return Path(urlsplit(text).path) if text.startswith("file://") else Path(text)


def check_uri(uri: str) -> None:
    """Refuse a URI with credentials or options in it (they belong in the environment)."""
    parts = urlsplit(uri)
    if parts.username is not None or parts.password is not None:
        raise StorageError(
            f"{parts.scheme}://{parts.hostname}{parts.path}: credentials in the URI are refused (they would "
            "reach config.json and logs); set them in the environment or the store's config files"
        )
    if parts.query or parts.fragment:
        raise StorageError(
            f"{parts.scheme}://{parts.netloc}{parts.path}: options in the URI ('?...') are refused; "
            "endpoints, regions and credentials come from the environment (AWS_ENDPOINT_URL, ...)"
        )
    if not parts.netloc and parts.scheme in ("s3", "gs", "gcs"):
        raise StorageError(f"{uri}: no bucket (expected {parts.scheme}://BUCKET/PATH)")


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StorageError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise StorageError(f"{name}={raw!r} must be positive")
    return value


def timeouts() -> tuple[float, float, int]:
    """(connect time-out, request time-out, attempts) from the environment."""
    return (
        _number("PSREC_STORAGE_CONNECT_TIMEOUT_S", DEFAULT_CONNECT_TIMEOUT_S),
        _number("PSREC_STORAGE_REQUEST_TIMEOUT_S", DEFAULT_REQUEST_TIMEOUT_S),
        int(_number("PSREC_STORAGE_ATTEMPTS", DEFAULT_ATTEMPTS)),
    )


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, netloc, path inside the file system) of a store URI; the path has no trailing slash.

    For s3 and gs the file system's path starts with the bucket (``bucket/run``); for hdfs it is the
    absolute path; for fsspec schemes it is what fsspec expects.
    """
    check_uri(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("s3", "gs", "gcs"):
        path = f"{parts.netloc}{parts.path}".rstrip("/")
    elif scheme == "hdfs":
        path = parts.path.rstrip("/") or "/"
    else:
        path = uri.split("://", 1)[1].rstrip("/")
    return scheme, parts.netloc, path


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system of a store URI (built once per process and environment) and the path in it."""
    scheme, netloc, path = split_uri(uri)
    keyed = [os.environ.get(name, "") for name in (*_S3_ENVIRONMENT, *_TIMEOUT_ENVIRONMENT)]
    environment = hashlib.sha256("\0".join(keyed).encode()).hexdigest()
    key = (scheme, netloc if scheme == "hdfs" else "", environment)
    with _lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = _build(scheme, netloc, uri)
    return found, path


def _build(scheme: str, netloc: str, uri: str) -> pafs.FileSystem:
    connect, request, attempts = timeouts()
    if scheme == "s3":
        return _s3(uri, connect, request, attempts)
    if scheme in ("gs", "gcs"):
        return pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=request))
    if scheme == "hdfs":
        host, _, port = netloc.partition(":")
        return pafs.HadoopFileSystem(host or "default", int(port or 0))
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem
    except ImportError:  # pragma: no cover - fsspec comes with the project's dependencies
        raise StorageError(f"{uri}: no file system for {scheme}:// (install fsspec)") from None
    try:
        handler = FSSpecHandler(fsspec.filesystem(scheme))
    except (ImportError, ValueError) as error:
        raise StorageError(f"{uri}: no file system for {scheme}:// ({error})") from None
    return PyFileSystem(handler)


def _s3(uri: str, connect: float, request: float, attempts: int) -> pafs.FileSystem:
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true" and not _s3_credentials_visible():
        raise StorageError(
            f"{uri}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE "
            "with ~/.aws/credentials) in the environment; instance credentials are disabled "
            "(AWS_EC2_METADATA_DISABLED=true)"
        )
    options: dict[str, object] = {
        "connect_timeout": connect,
        "request_timeout": request,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts),
    }
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise StorageError(f"AWS_ENDPOINT_URL {endpoint!r} is not an http(s)://HOST[:PORT] address")
        options["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        options["scheme"] = parts.scheme
        options.setdefault("region", "us-east-1")  # S3-compatible stores take any; skips a lookup
    return pafs.S3FileSystem(**options)


def _s3_credentials_visible() -> bool:
    """Whether credentials are in the environment or the usual files (instance ones aside)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return True
    if os.environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or os.environ.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    ):
        return True
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE"), os.environ.get("AWS_CONFIG_FILE")]
    files += [str(Path.home() / ".aws" / "credentials"), str(Path.home() / ".aws" / "config")]
    return any(name and Path(name).expanduser().is_file() for name in files)
