"""Bounded staleness, measured: no async step reads a row that misses more than `ps.staleness` of the
updates pushed before it, sync steps miss none, and `staleness: 0` trains exactly like sync.

The shards count every row's updates and log the versions each training pull returns
(`ParameterShard.record_versions`). With one trainer the k-th training pull of a shard is step k's
(every step pulls from and pushes to every shard), and a step pushes gradients for exactly the rows
it pulled, so the updates pushed to a row before step s are the earlier steps that read it; a row
read at step s misses (that count - its version) of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.config import RunConfig
from psrec.ps.shard import ParameterShard, VersionRead
from tests.conftest import small_run_config

STEPS = 40
BATCH = 64
CHUNK = 10  # the driver's calls: staleness lives inside one (each call ends with every push applied)


@pytest.fixture(scope="module")
def staleness_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from psrec.data.synth import write_synthetic_criteo

    root = tmp_path_factory.mktemp("staleness")
    write_synthetic_criteo(
        root / "train", rows=STEPS * BATCH, seed=11, cardinality_scale=0.002, row_group_rows=640
    )
    return {"train": {"format": "parquet", "paths": [str(root / "train" / "*.parquet")]}}


def staleness_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> RunConfig:
    settings = {"training.batch_size": BATCH, "ps.num_shards": 2}
    return small_run_config(sources, run_dir, **(settings | overrides))


def missed_updates(reads: list[VersionRead]) -> np.ndarray:
    """Per step (= training pull of one shard, one trainer): the most updates pushed before the step
    that any row it read was missing. A version ahead of the updates pushed so far fails."""
    pushed: dict[str, dict[int, int]] = {}  # table -> id -> steps so far that pushed to its row
    worst = np.zeros(len(reads), dtype=np.int64)
    for step, read in enumerate(reads):
        for table, (ids, versions) in read.items():
            counts = pushed.setdefault(table, {})
            expected = np.array([counts.get(key, 0) for key in ids.tolist()], dtype=np.int64)
            assert (versions <= expected).all(), f"step {step} read {table} rows updated by later steps"
            worst[step] = max(worst[step], int((expected - versions).max(initial=0)))
        for table, (ids, _) in read.items():
            counts = pushed[table]
            for key in ids.tolist():
                counts[key] = counts.get(key, 0) + 1
    return worst


def train_recorded(
    config: RunConfig, sources: dict[str, Any], *, runner_staleness: int | None = None
) -> tuple[list[np.ndarray], dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]], list[float]]:
    """Train STEPS steps in CHUNK-step calls with versions recorded; per shard the missed updates
    of each step, the dense state, the rows and the chunks' losses. `runner_staleness` overrides the
    runner's read-ahead (to check that the check notices a runner that reads too far ahead)."""
    from psrec.train.runtime import make_runtime

    runtime: Any = make_runtime(config, base_dir=".", data_sources=sources)
    try:
        ray_shards = config.ps.runtime == "ray"
        if ray_shards:
            import ray

            ray.get([shard.call.remote(ParameterShard.record_versions) for shard in runtime.shards])
        else:
            for shard in runtime.shards:
                shard.record_versions()
            if runner_staleness is not None:
                runtime.trainer.runner.staleness = runner_staleness
        runtime.start_epoch(0)
        losses = []
        for _ in range(STEPS // CHUNK):
            [result] = runtime.train_steps(CHUNK)
            assert result.steps == CHUNK
            losses.append(result.loss_sum / result.samples)
        if ray_shards:
            logs = ray.get([shard.call.remote(ParameterShard.version_log) for shard in runtime.shards])
        else:
            logs = [shard.version_log() for shard in runtime.shards]
        assert [len(log) for log in logs] == [STEPS] * len(logs)
        return [missed_updates(log) for log in logs], runtime.dense_states()[0], runtime.table_rows(), losses
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_steps_miss_at_most_staleness_updates(
    staleness_sources: dict[str, Any], tmp_path: Path, staleness: int
) -> None:
    config = staleness_config(staleness_sources, tmp_path, **{"ps.mode": "async", "ps.staleness": staleness})
    missed, _, _, _ = train_recorded(config, staleness_sources)
    for per_step in missed:
        assert per_step.max() <= staleness, per_step
        # The bound is reached (the test is not vacuous): a chunk's j-th step misses min(j, k).
        assert per_step.max() == staleness
        assert (per_step[::CHUNK] == 0).all()  # a chunk starts with every push applied


def test_the_check_catches_a_runner_that_reads_one_step_further_ahead(
    staleness_sources: dict[str, Any], tmp_path: Path
) -> None:
    config = staleness_config(staleness_sources, tmp_path, **{"ps.mode": "async", "ps.staleness": 1})
    missed, _, _, _ = train_recorded(config, staleness_sources, runner_staleness=2)
    assert max(int(per_step.max()) for per_step in missed) == 2  # > ps.staleness: the bound is broken


def test_staleness_zero_is_sync(staleness_sources: dict[str, Any], tmp_path: Path) -> None:
    sync_config = staleness_config(staleness_sources, tmp_path / "sync", **{"ps.mode": "sync"})
    sync_missed, sync_dense, sync_rows, sync_losses = train_recorded(sync_config, staleness_sources)
    async_config = staleness_config(
        staleness_sources, tmp_path / "async", **{"ps.mode": "async", "ps.staleness": 0}
    )
    async_missed, async_dense, async_rows, async_losses = train_recorded(async_config, staleness_sources)
    for per_step in [*sync_missed, *async_missed]:
        assert (per_step == 0).all(), per_step  # every step reads every earlier update
    assert async_losses == sync_losses
    for name, value in sync_dense.items():
        torch.testing.assert_close(async_dense[name], value, rtol=0, atol=0)
    assert async_rows.keys() == sync_rows.keys()
    for table, (ids, values) in sync_rows.items():
        np.testing.assert_array_equal(async_rows[table][0], ids)
        np.testing.assert_array_equal(async_rows[table][1], values)


@pytest.mark.ray
def test_ray_async_steps_miss_at_most_staleness_updates(
    ray_cluster: None, staleness_sources: dict[str, Any], tmp_path: Path
) -> None:
    """Shard actors run one caller's calls in submission order: the same bound as in process."""
    config = staleness_config(
        staleness_sources, tmp_path, **{"ps.runtime": "ray", "ps.mode": "async", "ps.staleness": 2}
    )
    missed, _, _, _ = train_recorded(config, staleness_sources)
    for per_step in missed:
        assert per_step.max() <= 2, per_step
        assert per_step.max() == 2
