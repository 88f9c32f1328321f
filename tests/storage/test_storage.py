"""psrec.storage: URIs to file systems, StoragePath on an S3-compatible server (moto on 127.0.0.1),
credentials and endpoints from the environment only, and bounded failures of unreachable stores."""

from __future__ import annotations

import pickle
import socket
import time
from pathlib import Path

import pytest

from psrec.storage import StorageError, StoragePath, location
from psrec.storage.filesystems import split_uri


def test_paths_stay_paths_and_uris_become_storage_paths(tmp_path: Path) -> None:
    assert location(tmp_path) == tmp_path
    assert location(f"file://{tmp_path}") == tmp_path
    assert location("runs/x") == Path("runs/x")
    remote = location("s3://bucket/runs/x/")
    assert isinstance(remote, StoragePath)
    assert str(remote) == "s3://bucket/runs/x"
    assert remote.name == "x" and remote.parent == StoragePath("s3://bucket/runs")
    assert (remote / "checkpoints").uri == "s3://bucket/runs/x/checkpoints"
    assert remote.with_name("y").uri == "s3://bucket/runs/y"
    assert StoragePath("s3://bucket").is_bucket_root and not remote.is_bucket_root
    assert pickle.loads(pickle.dumps(remote)) == remote  # only the URI travels to another process
    assert split_uri("s3://bucket/runs/x") == ("s3", "bucket", "bucket/runs/x")
    assert split_uri("hdfs://namenode:8020/runs/x")[2] == "/runs/x"
    with pytest.raises(ValueError, match="relative"):
        remote / "../escape"


@pytest.mark.parametrize(
    "uri",
    ["s3://KEY:SECRET@bucket/run", "s3://bucket/run?access_key=KEY&secret_key=SECRET", "s3:///run"],
)
def test_credentials_and_options_in_a_uri_are_refused(uri: str) -> None:
    with pytest.raises(StorageError) as caught:
        location(uri)
    assert "SECRET" not in str(caught.value)


def test_memory_store_through_fsspec() -> None:
    root = location("memory://psrec-test/run")
    (root / "a" / "b.bin").write_bytes(b"abc")
    assert root.is_dir() and (root / "a" / "b.bin").is_file()
    assert (root / "a" / "b.bin").stat().st_size == 3
    root.rmtree()
    assert not root.exists()


def test_s3_round_trip(s3_bucket: str, s3_server) -> None:
    assert s3_server.host == "127.0.0.1"  # the test server listens on loopback only
    root = StoragePath(f"s3://{s3_bucket}/run")
    assert not root.exists() and list(root.iterdir()) == []
    (root / "x" / "one.bin").write_bytes(b"1" * 10)
    (root / "x" / "two.bin").write_bytes(b"22")
    (root / "top.json").write_text("{}")
    assert root.is_dir() and (root / "top.json").is_file()
    assert [p.name for p in root.iterdir()] == ["top.json", "x"]
    assert [p.name for p in (root / "x").glob_files("*.bin")] == ["one.bin", "two.bin"]
    assert (root / "x" / "one.bin").stat().st_size == 10
    assert b"".join((root / "x" / "one.bin").read_chunks(3)) == b"1" * 10
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        (root / "missing.bin").read_bytes()
    (root / "x").rmtree()
    assert not (root / "x").exists() and (root / "top.json").exists()


def test_a_missing_bucket_is_named(s3_bucket: str) -> None:
    target = StoragePath("s3://psrec-no-such-bucket/run/file.json")
    with pytest.raises(StorageError, match="s3://psrec-no-such-bucket/run/file.json"):
        target.write_text("{}")


def test_an_unreachable_endpoint_fails_fast_and_names_the_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("PSREC_STORAGE_ATTEMPTS", "2")
    started = time.perf_counter()
    with pytest.raises(StorageError, match="s3://bucket/run"):
        StoragePath("s3://bucket/run").exists()
    assert time.perf_counter() - started < 5


def test_a_silent_endpoint_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts connections and never answers: the request time-out ends the call."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("PSREC_STORAGE_CONNECT_TIMEOUT_S", "1")
        monkeypatch.setenv("PSREC_STORAGE_REQUEST_TIMEOUT_S", "1")
        monkeypatch.setenv("PSREC_STORAGE_ATTEMPTS", "1")
        started = time.perf_counter()
        with pytest.raises(StorageError, match="s3://bucket/run"):
            StoragePath("s3://bucket/run").exists()
        assert time.perf_counter() - started < 8


def test_missing_credentials_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match=r"s3://bucket/run.*AWS_ACCESS_KEY_ID"):
        StoragePath("s3://bucket/run").exists()
