"""What both runtimes share: `Runtime`, the driver-side calls the training loop makes at step
boundaries, and `RuntimeBase`, which writes those calls once over three primitives each runtime
provides: call a `TrainerWorker` method on every trainer, call a `ParameterShard` method on every
table partition (a shard, or under strategy "collective" a trainer's local partition), and write /
restore the partitions' checkpoint files. Checkpoints are therefore saved and restored by one routine
(`RuntimeBase.save_checkpoint`, `RuntimeBase.restore`) whatever holds the tables.

The runtimes themselves, in this process or on Ray actors, are in `psrec.train.runtime`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from psrec import checkpoint
from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint
from psrec.cluster.groups import ActorGroup, Partitions
from psrec.config import RunConfig
from psrec.elastic import trainer_scaling
from psrec.elastic.runtime_api import ElasticRuntime
from psrec.embedding.tiered_table import tier_rates
from psrec.ps.shard import ParameterShard
from psrec.trainer import builders
from psrec.trainer.chunks import ChunkResult
from psrec.trainer.worker import TrainerWorker


class Runtime(ElasticRuntime, Protocol):
    """What the driver calls, at step boundaries (and, through `ElasticRuntime`, what the resharding
    controller it runs needs)."""

    def start_epoch(self, epoch: int) -> None: ...

    def train_steps(self, max_steps: int) -> list[ChunkResult]: ...

    def epoch_steps(self) -> int | None: ...

    def evaluate(self, split: str) -> dict[str, np.ndarray]: ...

    def scale_learning_rates(self, factor: float, *, dense: bool = True) -> None: ...

    def save_snapshot(self, tag: str) -> None: ...

    def restore_snapshot(self, tag: str) -> None: ...

    def table_stats(self) -> dict[str, dict[str, float]]: ...

    def evict(self, step: int) -> dict[str, int]: ...

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]: ...

    def dense_states(self) -> list[dict[str, Any]]: ...

    def machine_reports(self) -> list[dict[str, Any]]: ...

    def save_checkpoint(
        self, run_dir: str, *, kind: str, parent: CheckpointRef | None, extra: dict[str, Any]
    ) -> CheckpointRef: ...

    def restore(self, chain: list[CheckpointRef]) -> dict[str, Any]: ...

    def dead_actors(self) -> list[str]:
        """Names of the processes that no longer answer (empty when nothing can die on its own)."""
        ...

    def recover(self, chain: list[CheckpointRef]) -> dict[str, Any] | None:
        """Replace dead processes and roll back to `chain` (None: started over, nothing committed)."""
        ...

    def failovers(self) -> list[dict[str, Any]]:
        """Shards rebuilt alone from their logs so far (no rollback), with how long it took."""
        ...

    def shutdown(self) -> None: ...

    placement: dict[str, Any]


class RuntimeBase:
    """The driver-side calls of both runtimes, over the primitives each one implements."""

    config: RunConfig
    _lr_factor: float = 1.0
    # bucket -> shard once the shard count changed while training (`psrec.elastic.resharding`), and its version
    _bucket_map: np.ndarray | None = None
    _routing_version: int = 0
    # where each actor runs (`psrec.cluster.placement.placement_report`); empty in process
    placement: dict[str, Any] = {}  # replaced per runtime, never mutated

    # -- primitives ------------------------------------------------------------------------------
    # the trainers and the table partitions (shards, or each trainer's under strategy "collective"),
    # called through `psrec.cluster.groups`: in process or on Ray, the same typed calls
    trainer_group: ActorGroup[TrainerWorker]
    partitions: Partitions

    def _write_partitions(self, pending: PendingCheckpoint, kind: str) -> list[FileRecord]:
        raise NotImplementedError

    def _restore_partitions(self, chain: list[CheckpointRef], step: int) -> None:
        raise NotImplementedError

    @property
    def num_trainers(self) -> int:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def bucket_map(self) -> np.ndarray:
        """Bucket -> shard now: the config's layout until the shard count changes while training."""
        return builders.bucket_map(self.config) if self._bucket_map is None else self._bucket_map

    @property
    def routing_version(self) -> int:
        """The version of `bucket_map`: 0 for the config's layout, raised by each resharding."""
        return self._routing_version

    def set_bucket_map(self, bucket_map: np.ndarray, version: int) -> None:
        """Route by `bucket_map` (version `version`) from now on; trainers started later get it."""
        self._bucket_map, self._routing_version = bucket_map, version

    def start_epoch(self, epoch: int) -> None:
        self.trainer_group.call(TrainerWorker.start_epoch, epoch)

    def train_steps(self, max_steps: int) -> list[ChunkResult]:
        return self.trainer_group.call(TrainerWorker.train_steps, max_steps)

    def epoch_steps(self) -> int | None:
        steps = self.trainer_group.call(TrainerWorker.epoch_steps)
        known = [count for count in steps if count is not None]
        return max(known) if len(known) == len(steps) else None  # sync trainers step together

    def evaluate(self, split: str) -> dict[str, np.ndarray]:
        parts = self.trainer_group.call(TrainerWorker.evaluate, split)
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def scale_learning_rates(self, factor: float, *, dense: bool = True) -> None:
        self._lr_factor *= factor
        if dense:
            self.trainer_group.call(TrainerWorker.set_dense_learning_rate, factor)
        specs = builders.table_specs(self.config)
        for name, spec in specs.items():
            self.partitions.call(
                ParameterShard.set_learning_rate, spec.optimizer.lr * self._lr_factor, [name]
            )

    def save_snapshot(self, tag: str) -> None:
        self.trainer_group.call(TrainerWorker.save_snapshot, tag)
        self.partitions.call(ParameterShard.save_snapshot, tag)

    def restore_snapshot(self, tag: str) -> None:
        self.trainer_group.call(TrainerWorker.restore_snapshot, tag)
        self.partitions.call(ParameterShard.restore_snapshot, tag)

    def table_stats(self) -> dict[str, dict[str, float]]:
        return _sum_stats(self.partitions.call(ParameterShard.stats))

    def evict(self, step: int) -> dict[str, int]:
        """Evict rows as each table's eviction settings say, at `step`; rows evicted per table."""
        evicted: dict[str, int] = {}
        for counts in self.partitions.call(ParameterShard.evict, step):
            for table, count in counts.items():
                evicted[table] = evicted.get(table, 0) + int(count)
        return evicted

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return _merge_rows(self.partitions.call(ParameterShard.table_rows))

    def dense_states(self) -> list[dict[str, Any]]:
        return self.trainer_group.call(TrainerWorker.dense_state)

    def machine_reports(self) -> list[dict[str, Any]]:
        """Each trainer's machine and the dense precision it resolved there (`TrainerWorker.machine_report`)."""
        return self.trainer_group.call(TrainerWorker.machine_report)

    def compute_settings(self) -> list[dict[str, int | str]]:
        """Each trainer's thread counts and CPU dispatch, as its steps see them (`psrec.threads`)."""
        return self.trainer_group.call(TrainerWorker.compute_settings)

    def save_checkpoint(
        self, run_dir: str, *, kind: str, parent: CheckpointRef | None, extra: dict[str, Any]
    ) -> CheckpointRef:
        """Every partition writes its own file in parallel, the first trainer's dense state and every
        trainer's position go in, then the manifest commits it; the partitions then forget the rows
        the checkpoint holds (their next delta starts from it)."""
        states = self.trainer_group.call(TrainerWorker.checkpoint_state)
        pending = checkpoint.begin_checkpoint(run_dir, step=int(states[0]["step"]), kind=kind)  # type: ignore[arg-type]
        try:
            records = self._write_partitions(pending, kind)
            ref = checkpoint.commit_checkpoint(
                pending,
                shard_files=dict(enumerate(records)),
                dense=self.trainer_group.call_first(TrainerWorker.dense_checkpoint),
                trainers=states,
                extra=extra,
                config=self.config.fingerprint_dict(),
                bucket_map=self.bucket_map().tolist(),
                parent=parent,
            )
        except BaseException:
            checkpoint.abort_checkpoint(pending)
            raise
        self.partitions.call(ParameterShard.confirm_checkpoint)
        self._checkpoint_committed(ref)
        return ref

    def _checkpoint_committed(self, ref: CheckpointRef) -> None:
        """Called once every partition confirmed `ref` (shard failover starts its logs again there)."""

    def restore(self, chain: list[CheckpointRef]) -> dict[str, Any]:
        """Load `chain` into every partition and trainer; returns the step, the first trainer's state
        and the driver's `extra`. A chain of another trainer count deals the rest of its epoch to
        these trainers (`psrec.elastic.trainer_scaling.dealt_states`)."""
        data = checkpoint.load_checkpoint(chain[-1], shards=[])
        self._restore_partitions(chain, data.step)
        states = trainer_scaling.dealt_states(data.trainers, self.num_trainers)  # another trainer count
        self.trainer_group.call_each(TrainerWorker.restore, [(data.dense, state) for state in states])
        self._lr_factor = 1.0
        self.scale_learning_rates(float(data.extra.get("lr_factor", 1.0)), dense=False)
        return {"step": data.step, **states[0], "extra": data.extra}


def _sum_stats(per_shard: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, float]]:
    """Counts summed over shards (``steps``: the most any shard pushed), and a disk tier's rates."""
    total: dict[str, dict[str, int]] = {}
    for stats in per_shard:
        for table, values in stats.items():
            into = total.setdefault(table, {})
            for key, value in values.items():
                into[key] = (
                    max(into.get(key, 0), int(value)) if key == "steps" else into.get(key, 0) + int(value)
                )
    return {
        table: {**values, **(tier_rates(values) if "pull_hits" in values else {})}
        for table, values in total.items()
    }


def _merge_rows(
    per_shard: list[dict[str, tuple[np.ndarray, np.ndarray]]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-shard (ids, rows) -> one (ids, rows) per table, sorted by id."""
    merged = {}
    for table in per_shard[0]:
        ids = np.concatenate([rows[table][0] for rows in per_shard])
        values = np.concatenate([rows[table][1] for rows in per_shard])
        order = np.argsort(ids)
        merged[table] = (ids[order], values[order])
    return merged
