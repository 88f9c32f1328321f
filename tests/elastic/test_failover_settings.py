"""`fault_tolerance.shard_failover` settings: where the logs go, and what is refused (no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from psrec.config import ConfigError
from psrec.elastic.shard_failover import ShardFailover
from psrec.ps.replay import FRESH_FILE
from tests.conftest import small_run_config

SOURCES: dict[str, Any] = {"train": {"format": "parquet", "paths": ["unused.parquet"]}}


def test_on_by_default_and_off_for_collective_tables_or_without_checkpoints(tmp_path: Path) -> None:
    on = ShardFailover.for_run(small_run_config(SOURCES, tmp_path, **{"ps.runtime": "ray"}))
    assert on is not None
    on.close()
    off = {"fault_tolerance.shard_failover": False}
    assert ShardFailover.for_run(small_run_config(SOURCES, tmp_path, **off)) is None
    unsaved = {"checkpoint.enabled": False}
    assert ShardFailover.for_run(small_run_config(SOURCES, tmp_path, **unsaved)) is None
    collective = small_run_config(
        SOURCES,
        tmp_path,
        **{"fault_tolerance.shard_failover": True, "ps.strategy": "collective", "ps.runtime": "ray"},
    )
    assert ShardFailover.for_run(collective) is None


def test_each_runtime_logs_in_a_directory_of_its_own_and_removes_it(tmp_path: Path) -> None:
    overrides = {"fault_tolerance.shard_failover": True, "fault_tolerance.push_log": str(tmp_path / "logs")}
    first = ShardFailover.for_run(small_run_config(SOURCES, tmp_path / "run", **overrides))
    second = ShardFailover.for_run(small_run_config(SOURCES, tmp_path / "run", **overrides))
    assert first is not None and second is not None and first.root != second.root
    assert first.root.parent == tmp_path / "logs"
    options = first.shard_options(1)
    assert options["push_log"] == str(first.root / "shard-1")
    assert (first.root / "shard-1" / FRESH_FILE).exists()  # the first process starts fresh tables
    first.close()
    assert not first.root.exists() and second.root.exists()


def test_a_store_uri_as_the_log_directory_is_refused_by_name(tmp_path: Path) -> None:
    config = small_run_config(
        SOURCES,
        tmp_path,
        **{"fault_tolerance.shard_failover": True, "fault_tolerance.push_log": "s3://bucket/logs"},
    )
    with pytest.raises(ConfigError, match="fault_tolerance.push_log: 's3://bucket/logs'"):
        ShardFailover.for_run(config)
