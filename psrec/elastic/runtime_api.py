"""What the elastic machinery needs of a running job: the runtime's public API, as Protocols.

The runtimes (`psrec.train.runtime.LocalRuntime`, `RayRuntime`) sit above this package and
implement these; resharding, trainer scaling and trainer failover take a runtime typed by one of
them, so they reach the job only through public, typed calls (never its private fields) and this
package imports nothing from the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from psrec.cluster.groups import ActorGroup, Partitions
from psrec.config import RunConfig

if TYPE_CHECKING:
    from psrec.elastic.trainer_failover import Cursor
    from psrec.ps.bucket_move import BucketMove
    from psrec.ps.shard import ParameterShard
    from psrec.trainer.worker import TrainerWorker


class ShardSet(Protocol):
    """What the controller does with a runtime's shards (in process or Ray actors)."""

    def count(self) -> int: ...

    def capacity_error(self, count: int) -> str | None: ...

    def row_bytes(self) -> list[int]: ...

    def start(self, count: int) -> None: ...

    def ready(self) -> bool: ...

    def adopt(self, step: int) -> None: ...

    def move(self, moves: list[BucketMove], num_buckets: int) -> int: ...

    def switch(self, bucket_map: np.ndarray, version: int) -> None: ...

    def drop(self, moves: list[BucketMove], num_buckets: int) -> None: ...

    def retire(self, count: int) -> None: ...

    def abandon(self) -> None: ...


class RoutedRuntime(Protocol):
    """A runtime whose shards route by a bucket map that resharding changes."""

    config: RunConfig

    def bucket_map(self) -> np.ndarray:
        """Bucket -> shard now."""
        ...

    @property
    def routing_version(self) -> int:
        """The version of `bucket_map` (raised by each switch to a new map)."""
        ...

    def set_bucket_map(self, bucket_map: np.ndarray, version: int) -> None:
        """Route by `bucket_map` (version `version`) from now on: new trainers get it too."""
        ...


class InProcessRuntime(RoutedRuntime, Protocol):
    """The in-process runtime: its shards are `ParameterShard` objects in this process."""

    shards: list[ParameterShard]
    trainer_group: ActorGroup[TrainerWorker]


class RayActorsRuntime(RoutedRuntime, Protocol):
    """The Ray runtime: shard and trainer actors (handles), called through typed groups."""

    shards: list[Any]  # ShardActor handles
    trainers: list[Any]  # TrainerWorker handles
    cursors: list[Cursor]  # each trainer's place at the last step boundary
    trainer_group: ActorGroup[TrainerWorker]
    partitions: Partitions

    def start_shard(self, index: int) -> Any:
        """A new shard actor for `index` (not yet answering)."""
        ...

    def start_trainer(self, index: int, config: RunConfig | None = None) -> Any:
        """A new trainer actor for `index` (with `config`: one that joins a changed trainer count)."""
        ...

    def adopt_trainers(self, trainers: list[Any], config: RunConfig) -> None:
        """Train with `trainers` (handles, in rank order) under `config` from now on."""
        ...

    def form_group(self, timeout_s: float | None, join_timeout_s: float | None = None) -> None:
        """Every trainer joins a new process group for the dense allreduce."""
        ...

    def report_placement(self) -> None:
        """Take the placement report (where each actor runs) again."""
        ...


class ElasticRuntime(RoutedRuntime, Protocol):
    """What the resharding controller holds: the routing, the trainer count, and the shards as a
    `ShardSet` (None where the shard count cannot change)."""

    @property
    def num_trainers(self) -> int: ...

    def shard_set(self) -> ShardSet | None: ...
