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
from tests.conftest import small_run_config

MEMORY_ROWS = 40  # per table and shard: the tiny run's larger tables hold hundreds of rows per shard


def _storage(directory: Path, **options: Any) -> dict[str, Any]:
    directory.mkdir(exist_ok=True)
    return {"embedding.default.storage": {"memory_rows": MEMORY_ROWS, "disk_dir": str(directory), **options}}


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
    shutil.rmtree(str(list_checkpoints(run_dir)[-1].path))  # as if the run died before its last checkpoint
    (run_dir / "summary.json").unlink()  # an interrupted run leaves no summary
    resumed = train(small_run_config(synthetic_sources, run_dir, **options, **storage), resume=True)
    assert resumed["resumed_from"]["step"] == 30
    assert resumed["validation"] == plain["validation"]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_ray_run_equals_in_memory_run_and_its_shard_actors_read_ahead(synthetic_sources, tmp_path):
    """On Ray the trainer tells the shard actors each next batch's ids too: their prefetches serve
    promotions, and the run ends with the in-memory run's model."""
    ray = {"ps.runtime": "ray", "ps.num_shards": 2, "training.max_steps": 24}
    plain = train(small_run_config(synthetic_sources, tmp_path / "plain", **ray))
    storage = _storage(tmp_path / "disk", prefetch_min_rows=1)
    tiered = train(small_run_config(synthetic_sources, tmp_path / "tiered", **ray, **storage))
    _assert_same_run(plain, tiered)
    tables = [stats for stats in tiered["tables"].values() if "disk_rows" in stats]
    assert sum(stats["prefetch_hits"] for stats in tables) > 0


@pytest.mark.parametrize("problem", ["missing", "file", "full"])
def test_bad_disk_dir_is_refused_before_training(synthetic_sources, tmp_path, problem):
    disk = tmp_path / "disk"
    if problem == "file":
        disk.write_text("not a directory")
    storage: dict[str, Any] = {"disk_dir": str(disk), "memory_rows": 10}
    overrides: dict[str, Any] = {"embedding.default.storage": storage}
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


def _assert_tier_rates(summary: dict[str, Any]) -> None:
    """summary.json's per-step figures of each disk-tier table against its own counts."""
    tables = {name: stats for name, stats in summary["tables"].items() if "disk_rows" in stats}
    assert tables
    for name, stats in tables.items():
        assert 0 < stats["steps"] <= summary["steps"], name
        pulled = stats["pull_hits"] + stats["pull_misses"]
        assert stats["hit_rate"] == pytest.approx(stats["pull_hits"] / pulled)
        for count in ("promotions", "demotions", "disk_bytes_read", "disk_bytes_written"):
            assert stats[f"{count}_per_step"] == pytest.approx(stats[count] / stats["steps"]), (name, count)
    assert max(stats["steps"] for stats in tables.values()) == summary["steps"]
    assert any(stats["promotions_per_step"] > 0 for stats in tables.values())
    # the trainer told the in-process shards each next batch's ids: promotions came from prefetches
    assert sum(stats["prefetch_hits"] for stats in tables.values()) > 0
    for stats in tables.values():
        assert stats["prefetch_hits"] <= stats["promotions"]


def _serving_tables(run_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from psrec.serve.export import choose_chain, load_tables

    tables = load_tables(choose_chain(run_dir, None), precision="fp32")
    return {name: (table.ids, table.values()) for name, table in tables.items()}


def test_export_and_stats_of_a_run_with_a_disk_tier(synthetic_sources, tmp_path):
    """The serving tables exported from a run whose rows mostly lived on disk equal those of the
    in-memory run, id for id and bit for bit; summary.json carries the tiers' per-step rates, and
    the trainer's prefetches of each next batch's cold rows served promotions."""
    options = {"checkpoint.every_steps": 10}
    # this run's tables promote a few rows a step: prefetch whatever they promote
    storage = _storage(tmp_path / "d", prefetch_min_rows=1)
    plain = train(small_run_config(synthetic_sources, tmp_path / "plain", **options))
    tiered = train(small_run_config(synthetic_sources, tmp_path / "tiered", **options, **storage))
    _assert_same_run(plain, tiered)
    _assert_tier_rates(tiered)
    expected, exported = _serving_tables(tmp_path / "plain"), _serving_tables(tmp_path / "tiered")
    assert sorted(exported) == sorted(expected)
    for name, (ids, values) in expected.items():
        assert np.array_equal(exported[name][0], ids), name
        assert exported[name][1].tobytes() == values.tobytes(), name


def test_resume_with_another_storage_budget(synthetic_sources, tmp_path):
    """A run checkpointed with a disk tier resumes with a bigger budget, a smaller one, or none, and
    ends with the uninterrupted in-memory run's rows and validation."""
    from psrec.checkpoint import list_checkpoints

    options = {"checkpoint.every_steps": 10}
    plain_config = small_run_config(synthetic_sources, tmp_path / "plain", **options)
    plain = train(plain_config)
    expected_rows = _serving_tables(tmp_path / "plain")
    first = tmp_path / "first"
    storage = _storage(tmp_path / "disk")
    train(small_run_config(synthetic_sources, first, **options, **storage, **{"training.max_steps": 25}))
    assert list_checkpoints(first)[-1].step == 25
    (first / "summary.json").unlink()
    budgets: dict[str, dict[str, Any]] = {
        "bigger": {"embedding.default.storage": {"memory_rows": 100_000, "disk_dir": str(tmp_path / "disk")}},
        "smaller": {"embedding.default.storage": {"memory_rows": 5, "disk_dir": str(tmp_path / "disk")}},
        "none": {},
    }
    for label, budget in budgets.items():
        run_dir = tmp_path / label
        shutil.copytree(first, run_dir)
        config = small_run_config(synthetic_sources, run_dir, **options, **budget)
        resumed = train(config, resume=True)
        assert resumed["resumed_from"]["step"] == 25, label
        assert resumed["validation"] == plain["validation"], label
        rows = _serving_tables(run_dir)
        assert sorted(rows) == sorted(expected_rows), label
        for name, (ids, values) in expected_rows.items():
            assert np.array_equal(rows[name][0], ids) and rows[name][1].tobytes() == values.tobytes(), (
                label,
                name,
            )
