"""A runtime's shards as the resharding controller sees them (`psrec.elastic.resharding`).

`ShardSet` is what a resharding does with shards: start new ones (without waiting), adopt them at a
step boundary, move buckets (`psrec.ps.bucket_move`), switch every trainer to a new bucket map,
drop the moved copies and stop emptied shards. `LocalShards` does it for the in-process runtime's
`ParameterShard`s, `RayShards` for the Ray runtime's shard actors: an exported bucket goes from its
source actor to its destination through Ray's object store (the driver reads each export's answer
to see whether its source failed: on one node a mapping of the shared store, on a cluster a copy to
the driver's node).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import numpy as np

from psrec.cluster.groups import RemoteCall, answered, answered_refs
from psrec.elastic.runtime_api import InProcessRuntime, RayActorsRuntime
from psrec.ps import bucket_move
from psrec.ps.actors import ShardActor
from psrec.ps.bucket_move import BucketMove
from psrec.ps.shard import ParameterShard
from psrec.trainer import builders
from psrec.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)


class LocalShards:
    """The in-process runtime's shards (`psrec.train.runtime.LocalRuntime`)."""

    def __init__(self, runtime: InProcessRuntime) -> None:
        self.runtime = runtime
        self._starting: list[ParameterShard] = []

    def count(self) -> int:
        return len(self.runtime.shards)

    def capacity_error(self, count: int) -> str | None:
        return None

    def row_bytes(self) -> list[int]:
        return [_row_bytes(shard.stats()) for shard in self.runtime.shards]

    def start(self, count: int) -> None:
        config = self.runtime.config
        self._starting = [
            ParameterShard(
                index,
                builders.build_tables(config, partitions=config.ps.num_shards),
                num_trainers=1,
                mode=config.ps.mode,
            )
            for index in range(self.count(), count)
        ]

    def ready(self) -> bool:
        return True

    def adopt(self, step: int) -> None:
        for shard in self._starting:
            bucket_move.start_at(shard, step)
        self.runtime.shards.extend(self._starting)
        self._starting = []

    def move(self, moves: list[BucketMove], num_buckets: int) -> int:
        shards = self.runtime.shards
        return sum(
            bucket_move.add_bucket_rows(
                shards[m.destination],
                bucket_move.bucket_rows(shards[m.source], m.buckets, num_buckets),
                num_buckets=num_buckets,
            )
            for m in moves
        )

    def switch(self, bucket_map: np.ndarray, version: int) -> None:
        self.runtime.set_bucket_map(bucket_map, version)
        routed = self.runtime.shards[: int(bucket_map.max()) + 1]
        _check_versions(
            self.runtime.trainer_group.call(TrainerWorker.set_routing, routed, bucket_map, version), version
        )

    def drop(self, moves: list[BucketMove], num_buckets: int) -> None:
        for m in moves:
            bucket_move.drop_buckets(self.runtime.shards[m.source], m.buckets, num_buckets)

    def retire(self, count: int) -> None:
        del self.runtime.shards[count:]

    def abandon(self) -> None:
        self._starting = []


class RayShards:
    """The Ray runtime's shard actors (`psrec.train.runtime.RayRuntime`)."""

    def __init__(self, runtime: RayActorsRuntime) -> None:
        self.runtime = runtime
        self._starting: list[Any] = []
        self._answers: list[Any] = []

    def count(self) -> int:
        return len(self.runtime.shards)

    def capacity_error(self, count: int) -> str | None:
        import ray

        ps = self.runtime.config.ps
        added = max(0, count - self.count()) * ps.shard_resources.num_cpus
        free = ray.available_resources().get("CPU", 0.0)
        if added > free:
            return (
                f"{count} shards need {added:g} more CPUs (ps.shard_resources.num_cpus "
                f"{ps.shard_resources.num_cpus:g} each) but the Ray cluster has {free:g} free: add nodes or "
                "lower ps.shard_resources.num_cpus"
            )
        return None

    def row_bytes(self) -> list[int]:
        return [_row_bytes(stats) for stats in self.runtime.partitions.call(ParameterShard.stats)]

    def start(self, count: int) -> None:
        self._starting = [self.runtime.start_shard(index) for index in range(self.count(), count)]
        self._answers = [RemoteCall(shard, ShardActor.pid).send() for shard in self._starting]

    def ready(self) -> bool:
        return all_answered(self._answers)

    def adopt(self, step: int) -> None:
        answered([RemoteCall(shard, ShardActor.start_at, (step,)) for shard in self._starting])
        self.runtime.shards.extend(self._starting)
        self._starting, self._answers = [], []
        self._refresh_placement()  # summary.json's placement names the new shards' nodes

    def move(self, moves: list[BucketMove], num_buckets: int) -> int:
        shards = self.runtime.shards
        # each export goes from its source to its destination in the object store; the exports are
        # all answered before any import starts, so that a shard restarted meanwhile (shard failover)
        # is sent again only its own call
        exported = answered_refs(
            [
                RemoteCall(shards[m.source], ShardActor.export_buckets, (list(m.buckets), num_buckets))
                for m in moves
            ]
        )
        imports = [
            RemoteCall(
                shards[m.destination], ShardActor.import_buckets, (rows, num_buckets, uuid.uuid4().hex)
            )
            for m, rows in zip(moves, exported, strict=True)
        ]
        return int(sum(answered(imports)))

    def switch(self, bucket_map: np.ndarray, version: int) -> None:
        self.runtime.set_bucket_map(bucket_map, version)
        routed = self.runtime.shards[: int(bucket_map.max()) + 1]
        _check_versions(
            self.runtime.trainer_group.call(TrainerWorker.set_routing, routed, bucket_map, version), version
        )

    def drop(self, moves: list[BucketMove], num_buckets: int) -> None:
        shards = self.runtime.shards
        answered(
            [
                RemoteCall(shards[m.source], ShardActor.drop_buckets, (list(m.buckets), num_buckets))
                for m in moves
            ]
        )

    def retire(self, count: int) -> None:
        import ray

        for shard in self.runtime.shards[count:]:
            ray.kill(shard)
        del self.runtime.shards[count:]
        self._refresh_placement()

    def _refresh_placement(self) -> None:
        """The runtime's placement report taken again; a shard being rebuilt meanwhile (shard failover)
        leaves the previous report, never fails the resharding."""
        from ray.exceptions import RayActorError

        try:
            self.runtime.report_placement()
        except (RayActorError, TimeoutError) as error:
            logger.warning("placement report not taken again after the resharding: %s", error)

    def abandon(self) -> None:
        import ray

        for shard in self._starting:
            ray.kill(shard)
        self._starting, self._answers = [], []


def all_answered(refs: list[Any]) -> bool:
    """Whether every call of `refs` has answered (without waiting); an actor that failed to start
    raises its error here."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if len(done) < len(refs):
        return False
    ray.get(done)
    return True


def _row_bytes(stats: dict[str, dict[str, int]]) -> int:
    """The bytes a shard's rows take, over its tables (`ParameterShard.stats`)."""
    return sum(int(table["row_bytes"]) for table in stats.values())


def _check_versions(versions: list[int], version: int) -> None:
    if any(v != version for v in versions):
        raise RuntimeError(f"trainers route with bucket map versions {versions}, the driver with {version}")
