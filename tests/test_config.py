"""`training.dense_precision` in the run config: ``auto`` by default, the explicit settings kept, and
the resume fingerprint that lets a checkpoint written with ``fp32`` (the default before ``auto``)
resume under the new default."""

from __future__ import annotations

from pathlib import Path

import pytest

from psrec.checkpoint.policy import config_differences
from psrec.config import ConfigError, RunConfig, parse_config
from tests.conftest import small_run_config

SOURCES = {"train": {"format": "parquet", "paths": ["unused/*.parquet"]}}


def test_dense_precision_defaults_to_auto_and_keeps_explicit_settings(tmp_path: Path) -> None:
    assert small_run_config(SOURCES, tmp_path).training.dense_precision == "auto"
    for setting in ("fp32", "bf16"):
        config = small_run_config(SOURCES, tmp_path, **{"training.dense_precision": setting})
        assert config.training.dense_precision == setting
    with pytest.raises(ConfigError, match="training.dense_precision"):
        small_run_config(SOURCES, tmp_path, **{"training.dense_precision": "fp16"})


def test_a_checkpoint_written_with_fp32_resumes_under_auto(tmp_path: Path) -> None:
    """The fingerprint leaves the precision out (a checkpoint holds fp32 weights, optimizer state and
    rows whatever precision trained them). A checkpoint of an older psrec holds its fingerprint with
    ``dense_precision: fp32``; the driver re-validates a saved fingerprint with today's schema before
    comparing it (`psrec.train.loop`), as here."""
    written = small_run_config(SOURCES, tmp_path, **{"training.dense_precision": "fp32"})
    saved = written.fingerprint_dict()
    assert "dense_precision" not in saved["training"]
    saved["training"]["dense_precision"] = "fp32"  # as an older psrec wrote it
    normalized = RunConfig.model_validate(saved).fingerprint_dict()
    resumed = small_run_config(SOURCES, tmp_path)  # the default: auto
    assert config_differences(normalized, resumed.fingerprint_dict()) == []
    bf16 = small_run_config(SOURCES, tmp_path, **{"training.dense_precision": "bf16"})
    assert config_differences(normalized, bf16.fingerprint_dict()) == []
    other = small_run_config(SOURCES, tmp_path, **{"training.batch_size": 128})  # still compared
    assert [path for path, _, _ in config_differences(normalized, other.fingerprint_dict())] == [
        "training.batch_size"
    ]


def test_a_pipeline_accepts_auto_and_refuses_bf16(tmp_path: Path) -> None:
    from psrec.data.sequences import sasrec_schema

    data = {
        "run_dir": str(tmp_path),
        "data": {
            "schema": sasrec_schema(8).model_dump(),
            "train": {"format": "interactions", "paths": ["x"]},
        },
        "model": {"name": "sasrec", "max_length": 8, "num_blocks": 2, "num_heads": 1},
        "embedding": {"default": {"dim": 8}},
        "ps": {"runtime": "ray", "num_trainers": 2, "pipeline": {"stages": 2}},
    }
    assert parse_config(data).training.dense_precision == "auto"
    assert parse_config(data, overrides={"training.dense_precision": "fp32"}).ps.pipeline is not None
    with pytest.raises(ConfigError, match="ps.pipeline supports training.dense_precision fp32 only"):
        parse_config(data, overrides={"training.dense_precision": "bf16"})
