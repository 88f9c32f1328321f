"""A training run whose run_dir and data live on an S3-compatible store (moto on 127.0.0.1):
checkpoints, config.json, summary.json and TensorBoard events go there, the run resumes from them,
and an unreachable store stops the run before training with a ConfigError naming the URI."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from psrec import checkpoint
from psrec.config import ConfigError
from psrec.storage import StoragePath
from psrec.train.loop import train
from psrec.train.run_dir import MARKER
from tests.conftest import small_run_config

SETTINGS = {"checkpoint.every_steps": 5, "training.log_every_steps": 5, "training.max_steps": 10}


def _upload(sources: dict[str, Any], bucket: str) -> dict[str, Any]:
    """The synthetic Parquet sets copied to s3://BUCKET/data/SPLIT/, as sources with s3:// globs."""
    stored = {}
    for split, source in sources.items():
        local = Path(source["paths"][0])
        for path in sorted(local.parent.glob(local.name)):
            StoragePath(f"s3://{bucket}/data/{split}/{path.name}").write_bytes(path.read_bytes())
        stored[split] = {"format": "parquet", "paths": [f"s3://{bucket}/data/{split}/*.parquet"]}
    return stored


def test_a_run_on_an_object_store_writes_there_and_resumes(
    s3_bucket: str, synthetic_sources: dict[str, Any]
) -> None:
    sources = _upload(synthetic_sources, s3_bucket)
    run = f"s3://{s3_bucket}/runs/one"
    first = train(small_run_config(sources, run, **SETTINGS))  # type: ignore[arg-type]
    root = StoragePath(run)
    assert {MARKER, "config.json", "summary.json", "checkpoints", "tensorboard"} <= {
        p.name for p in root.iterdir()
    }
    assert json.loads((root / "summary.json").read_text())["rows_consumed"] == first["rows_consumed"]
    config_text = (root / "config.json").read_text()
    assert "testing-secret" not in config_text and "AWS_" not in config_text  # no credentials
    steps = [ref.step for ref in checkpoint.list_checkpoints(run)]
    assert steps and max(steps) == 10

    resumed = train(small_run_config(sources, run, **SETTINGS | {"training.max_steps": 20}), resume=True)  # type: ignore[arg-type]
    assert resumed["resumed_from"]["step"] == 10
    assert max(ref.step for ref in checkpoint.list_checkpoints(run)) == 20


def test_a_finished_run_on_an_object_store_is_not_moved_aside(
    s3_bucket: str, synthetic_sources: dict[str, Any]
) -> None:
    sources = _upload({"train": synthetic_sources["train"]}, s3_bucket)
    run = f"s3://{s3_bucket}/runs/two"
    train(small_run_config(sources, run, **SETTINGS | {"training.max_steps": 2}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot move it aside"):
        train(small_run_config(sources, run, **SETTINGS | {"training.max_steps": 2}))  # type: ignore[arg-type]


def test_an_unreachable_store_stops_the_run_before_training(
    monkeypatch: pytest.MonkeyPatch, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("PSREC_STORAGE_ATTEMPTS", "2")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="s3://bucket/runs/x"):
        train(small_run_config(synthetic_sources, "s3://bucket/runs/x", **SETTINGS))  # type: ignore[arg-type]
    stored = {"train": {"format": "parquet", "paths": ["s3://bucket/data/*.parquet"]}}
    with pytest.raises(ConfigError, match=r"data.train.paths.*s3://bucket/data/\*.parquet"):
        train(small_run_config(stored, tmp_path / "run", **SETTINGS))
    assert time.perf_counter() - started < 10
    assert not (tmp_path / "run").exists()  # nothing written before the error
