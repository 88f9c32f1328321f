"""A trainer's connections to its shards, before and after the shards change (`TrainerWorker`).

A shard answers a training pull sent again under the same (caller, request) with the rows of the
first (`psrec.ps.replay`): that is how a replacement trainer's repeated pull gets what the trainer
it replaces got. The oracle is the first pull's rows, taken before a push changed them.

Run: `python -m pytest tests/trainer/test_worker_connections.py -q` (starts a local Ray cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import small_run_config


def _logged_shard(ray: Any, specs: list[Any], directory: Path) -> Any:
    from psrec.ps.actors import ShardActor
    from psrec.ps.replay import prepare_fresh

    prepare_fresh(directory)
    return (
        ray.remote(ShardActor)
        .options(num_cpus=0)
        .remote(0, specs, num_trainers=1, mode="sync", push_log=str(directory))
    )


@pytest.mark.ray
def test_after_the_shards_change_a_trainer_still_pulls_under_its_own_name(
    ray_cluster: None, synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    import ray

    from psrec.ps.actors import RayConnection
    from psrec.trainer import builders
    from psrec.trainer.worker import TrainerWorker

    config = small_run_config(synthetic_sources, tmp_path / "run", **{"ps.runtime": "ray"})
    specs = builders.shard_table_specs(config)
    before = [_logged_shard(ray, specs, tmp_path / f"log-{i}") for i in range(2)]
    worker = TrainerWorker(config, 1, before, data_sources=synthetic_sources)
    after = _logged_shard(ray, specs, tmp_path / "log-after")
    worker.set_routing([after], np.zeros(config.ps.num_buckets, np.int64), version=1)
    connection = worker.client.client.connections[0]

    table = specs[0].name
    ids = {table: np.arange(40, dtype=np.int64)}
    first = np.array(connection.pull(ids, train=True, request=7).result()[table])
    grads = {table: (ids[table], np.ones((40, specs[0].dim), np.float32))}
    assert connection.push(1, 0, 6, grads).result()
    replacement = RayConnection(after, caller="trainer-1")  # the trainer that replaces it
    again = replacement.pull(ids, train=True, request=7).result()[table]
    np.testing.assert_array_equal(again, first)
    changed = replacement.pull(ids, train=False).result()[table]
    assert not np.array_equal(changed, first)  # the push did change the rows
    worker.shutdown()
