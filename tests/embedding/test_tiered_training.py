"""Training with a disk tier end to end: the run with `storage` (most rows on disk) ends with the model of
the all-in-memory run (every table row, validation AUC and logloss), in process and on Ray; a bad
disk_dir is a ConfigError naming it before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.config import ConfigError
from psrec.train.loop import train
from psrec.train.runtime import make_runtime
from tests.conftest import small_run_config

MEMORY_ROWS = 40  # per table and shard: the tiny run's larger tables hold hundreds of rows per shard


def _rows(config) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    runtime = make_runtime(config)
    try:
        return runtime.table_rows()
    finally:
        runtime.shutdown()


def _storage(directory: Path) -> dict[str, Any]:
    directory.mkdir(exist_ok=True)
    return {"embedding.default.storage": {"memory_rows": MEMORY_ROWS, "disk_dir": str(directory)}}


def _assert_same_run(plain: dict[str, Any], tiered: dict[str, Any]) -> None:
    assert tiered["validation"] == plain["validation"]
    assert tiered["steps"] == plain["steps"]
    for name, stats in plain["tables"].items():
        assert tiered["tables"][name]["rows"] == stats["rows"], name
    tiered_tables = {name: stats for name, stats in tiered["tables"].items() if "disk_rows" in stats}
    assert tiered_tables
    disk = sum(stats["disk_rows"] for stats in tiered_tables.values())
    memory = sum(stats["memory_rows"] for stats in tiered_tables.values())
    assert disk > memory  # most rows lived on disk
    assert sum(stats["promotions"] for stats in tiered_tables.values()) > 0
    for stats in tiered_tables.values():
        assert stats["memory_rows"] + stats["disk_rows"] == stats["rows"]


def test_in_process_run_equals_in_memory_run(synthetic_sources, tmp_path):
    plain = train(small_run_config(synthetic_sources, tmp_path / "plain"))
    tiered = train(small_run_config(synthetic_sources, tmp_path / "tiered", **_storage(tmp_path / "disk")))
    _assert_same_run(plain, tiered)
    assert plain["validation"]["auc"] > 0.6


def test_tiered_checkpoint_resume_equals_uninterrupted_run(synthetic_sources, tmp_path):
    """A run with a disk tier stopped at step 35 and resumed from its checkpoint chain (a full one at
    step 0, deltas at 10, 20, 30: cold rows included) ends like the uninterrupted in-memory run."""
    from psrec.checkpoint import list_checkpoints

    options = {"checkpoint.every_steps": 10, "training.log_every_steps": 5}
    plain = train(small_run_config(synthetic_sources, tmp_path / "plain", **options))
    storage = _storage(tmp_path / "disk")
    run_dir = tmp_path / "tiered"
    train(small_run_config(synthetic_sources, run_dir, **options, **storage, **{"training.max_steps": 35}))
    chain = [(ref.kind, ref.step) for ref in list_checkpoints(run_dir)]
    assert chain[-4:] == [("delta", 10), ("delta", 20), ("delta", 30), ("full", 35)], chain
    shutil.rmtree(list_checkpoints(run_dir)[-1].path)  # as if the run died before its last checkpoint
    (run_dir / "summary.json").unlink()  # an interrupted run leaves no summary
    resumed = train(small_run_config(synthetic_sources, run_dir, **options, **storage), resume=True)
    assert resumed["resumed_from"]["step"] == 30
    assert resumed["validation"] == plain["validation"]


@pytest.mark.slow  # about 40 s on 2 loaded cores
@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_ray_run_equals_in_memory_run(synthetic_sources, tmp_path):
    ray = {"ps.runtime": "ray", "ps.num_shards": 2}
    plain = train(small_run_config(synthetic_sources, tmp_path / "plain", **ray))
    tiered = train(
        small_run_config(synthetic_sources, tmp_path / "tiered", **ray, **_storage(tmp_path / "disk"))
    )
    _assert_same_run(plain, tiered)


@pytest.mark.parametrize("problem", ["missing", "file", "full"])
def test_bad_disk_dir_is_refused_before_training(synthetic_sources, tmp_path, problem):
    disk = tmp_path / "disk"
    if problem == "file":
        disk.write_text("not a directory")
    storage: dict[str, Any] = {"disk_dir": str(disk), "memory_rows": 10}
    overrides = {"embedding.default.storage": storage}
    if problem == "full":
        disk.mkdir()
        overrides["embedding.default.expected_rows"] = 10**15  # more rows on disk than it has room for
    config = small_run_config(synthetic_sources, tmp_path / "run", **overrides)
    message = {
        "missing": "does not exist",
        "file": "is not a directory",
        "full": "has .* GiB free, the disk tier needs",
    }
    with pytest.raises(ConfigError, match=f"storage.disk_dir '{disk}' {message[problem]}"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_storage_config_needs_one_budget(synthetic_sources, tmp_path):
    for storage in (
        {"disk_dir": str(tmp_path)},
        {"disk_dir": str(tmp_path), "memory_rows": 5, "memory_gb": 1},
    ):
        with pytest.raises(ConfigError, match="exactly one of memory_rows and memory_gb"):
            small_run_config(synthetic_sources, tmp_path, **{"embedding.default.storage": storage})
