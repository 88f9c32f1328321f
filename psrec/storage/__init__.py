"""Storage: one place that turns a path or URI into something to read and write.

A local path (or ``file://`` URI) stays a `pathlib.Path`; ``s3://``, ``gs://``, ``hdfs://`` and any
scheme fsspec knows become a `StoragePath` on a pyarrow file system (`psrec.storage.filesystems`:
credentials, endpoints and time-outs from the environment). The bottom layer: it imports nothing of
psrec. Tests: ``python -m pytest tests/storage -q`` (an S3-compatible moto server on 127.0.0.1).
"""

from psrec.storage.filesystems import StorageError, filesystem, is_uri, timeouts
from psrec.storage.paths import Location, StoragePath, copy_tree, location

__all__ = [
    "Location",
    "StorageError",
    "StoragePath",
    "copy_tree",
    "filesystem",
    "is_uri",
    "location",
    "timeouts",
]
