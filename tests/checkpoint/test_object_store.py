"""Checkpoints on an S3-compatible store (moto on 127.0.0.1): the manifest-last commit without
rename, full + delta chains, retention, torn and corrupt checkpoints, and unreachable stores."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest
import torch

from psrec import checkpoint
from psrec.checkpoint import CheckpointData, CheckpointError
from psrec.checkpoint.format import NAME_PATTERN
from psrec.storage import StoragePath

CONFIG = {"model": {"hidden": [8, 4]}}


def _data(step: int, value: float) -> CheckpointData:
    return CheckpointData(
        step=step,
        shards={
            0: {"t/ids": np.arange(4, dtype=np.int64) + step, "t/rows": np.full((4, 2), value, np.float32)},
            1: {"t/ids": np.arange(3, dtype=np.int64), "t/rows": np.full((3, 2), -value, np.float32)},
        },
        dense={"weight": torch.full((2,), value)},
        trainers=[{"position": step}],
        extra={"epoch": 0},
    )


def _save(run: str, step: int, kind: str, parent=None, value: float = 1.0):
    return checkpoint.save_checkpoint(
        run, _data(step, value), config=CONFIG, kind=kind, bucket_map=[0, 1], parent=parent
    )


def test_full_and_delta_chain_round_trip(s3_bucket: str) -> None:
    run = f"s3://{s3_bucket}/run"
    full = _save(run, 0, "full")
    delta1 = _save(run, 10, "delta", full, value=2.0)
    delta2 = _save(run, 20, "delta", delta1, value=3.0)
    assert isinstance(full.path, StoragePath) and full.path.uri.startswith(f"{run}/checkpoints/")
    assert all(NAME_PATTERN.match(ref.name) for ref in (full, delta1, delta2))
    chain = checkpoint.resolve_restore_chain(run, config=CONFIG)
    assert [ref.checkpoint_id for ref in chain] == [r.checkpoint_id for r in (full, delta1, delta2)]
    for ref in chain:
        checkpoint.verify(ref)
    last = checkpoint.load_checkpoint(chain[-1])
    assert last.step == 20 and last.trainers == [{"position": 20}]
    np.testing.assert_array_equal(last.shards[0]["t/rows"], np.full((4, 2), 3.0, np.float32))
    assert torch.equal(last.dense["weight"], torch.full((2,), 3.0))
    only_one = checkpoint.load_checkpoint(full, shards=[1], dense=False)
    assert list(only_one.shards) == [1] and only_one.dense == {}


def test_a_replaced_checkpoint_is_deleted_after_the_new_one_commits(s3_bucket: str) -> None:
    run = f"s3://{s3_bucket}/run"
    first = _save(run, 0, "full", value=1.0)
    second = _save(run, 0, "full", value=5.0)
    listed = checkpoint.list_checkpoints(run)
    assert [ref.checkpoint_id for ref in listed] == [second.checkpoint_id]
    assert not first.path.exists()
    assert checkpoint.load_checkpoint(listed[0]).dense["weight"][0] == 5.0


def test_retention_deletes_old_chains_and_torn_writes(s3_bucket: str) -> None:
    run = f"s3://{s3_bucket}/run"
    old = _save(run, 0, "full")
    old_delta = _save(run, 10, "delta", old)
    new = _save(run, 20, "full")
    kept = _save(run, 30, "delta", new)
    torn = StoragePath(f"{run}/checkpoints/ckpt-000000040-full.0123abcd")
    (torn / "shard-0.npz").write_bytes(b"half an upload")
    deleted = checkpoint.apply_retention(run, keep_last=1)
    assert sorted(p.name for p in deleted) == sorted([old.name, old_delta.name, torn.name])
    assert [ref.checkpoint_id for ref in checkpoint.list_checkpoints(run)] == [
        new.checkpoint_id,
        kept.checkpoint_id,
    ]
    assert not torn.exists() and not old.path.exists()


def test_a_torn_checkpoint_is_skipped_and_named(s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    run = f"s3://{s3_bucket}/run"
    good = _save(run, 0, "full")
    torn = StoragePath(f"{run}/checkpoints/ckpt-000000010-full.89abcdef")
    for name in ("shard-0.npz", "shard-1.npz", "dense.pt", "trainers.json"):  # every file, no manifest
        (torn / name).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="psrec.checkpoint"):
        chain = checkpoint.resolve_restore_chain(run, config=CONFIG)
    assert [ref.checkpoint_id for ref in chain] == [good.checkpoint_id]
    assert any(torn.name in r.getMessage() and "no manifest" in r.getMessage() for r in caplog.records)


def test_a_corrupt_file_is_caught_by_its_sha256(s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    run = f"s3://{s3_bucket}/run"
    good = _save(run, 0, "full")
    bad = _save(run, 10, "full", value=7.0)
    shard = bad.path / "shard-0.npz"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard-0.npz is corrupt: sha256"):
        checkpoint.verify(bad)
    with caplog.at_level(logging.WARNING, logger="psrec.checkpoint"):
        chain = checkpoint.resolve_restore_chain(run, config=CONFIG)
    assert [ref.checkpoint_id for ref in chain] == [good.checkpoint_id]
    assert any(bad.name in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)


def test_an_unreachable_store_is_a_checkpoint_error_naming_the_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("PSREC_STORAGE_ATTEMPTS", "2")
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="s3://bucket/run/checkpoints"):
        checkpoint.list_checkpoints("s3://bucket/run")
    with pytest.raises(CheckpointError, match="s3://bucket/run"):
        _save("s3://bucket/run", 0, "full")
    assert time.perf_counter() - started < 10
