"""Where the shards and trainers run: in this process (`LocalRuntime`) or as Ray actors (`RayRuntime`).

Both expose the same driver-side calls (`Runtime`), so the training loop in `psrec.train.loop` does
not know which one it drives. What they share is written once in `RuntimeBase`
(`psrec.train.runtime_base`); each runtime provides its primitives: its trainer group, its table
partitions, and writing / restoring the partitions' checkpoint files.

The Ray runtime starts an embedded single-machine cluster on loopback when no address is given, or
joins the cluster at `ps.address` (`psrec.cluster.start`). `shutdown()` kills every actor it started,
on success, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint
from psrec.cluster import placement
from psrec.cluster.groups import ActorGroup, Partitions, answers, gather
from psrec.cluster.start import ray_start_arguments, required_cpus, settle_lost_actors, start_ray, stop_ray
from psrec.config import ConfigError, RunConfig
from psrec.elastic import trainer_failover
from psrec.elastic.runtime_api import ShardSet
from psrec.elastic.shard_failover import ShardFailover
from psrec.elastic.shard_set import LocalShards, RayShards
from psrec.ps.actors import ShardActor
from psrec.ps.shard import ParameterShard
from psrec.ps.shard_checkpoint import restore_shard, write_shard_checkpoint
from psrec.ps.shared_arrays import unlink_job_segments
from psrec.threads import set_thread_counts
from psrec.train.runtime_base import Runtime, RuntimeBase
from psrec.trainer import builders
from psrec.trainer.chunks import ChunkResult
from psrec.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)


class LocalRuntime(RuntimeBase):
    """Shards and one trainer in this process: no Ray (debugging, unit tests, the in-process bench)."""

    def __init__(self, config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> None:
        set_thread_counts(config.ps.trainer_resources.threads)
        self.config = config
        self.shards = [
            ParameterShard(
                i,
                builders.build_tables(config, partitions=config.ps.num_shards),
                num_trainers=1,
                mode=config.ps.mode,
            )
            for i in range(config.ps.num_shards)
        ]
        self.trainer = TrainerWorker(
            config, 0, list(self.shards), base_dir=base_dir, data_sources=data_sources
        )
        self._lr_factor = 1.0
        self.trainer_group = ActorGroup(lambda: [self.trainer], on_ray=False)
        self.partitions = Partitions(ActorGroup(lambda: self.shards, on_ray=False), held_by="process")

    @property
    def num_trainers(self) -> int:
        return 1

    def shard_set(self) -> ShardSet:
        """The shards as the resharding controller changes them (`psrec.elastic.shard_set`)."""
        return LocalShards(self)

    def _write_partitions(self, pending: PendingCheckpoint, kind: str) -> list[FileRecord]:
        return [write_shard_checkpoint(shard, pending, kind) for shard in self.shards]

    def _restore_partitions(self, chain: list[CheckpointRef], step: int) -> None:
        for shard in self.shards:  # a chain of another shard count is resharded on the way in
            restore_shard(shard, chain, step, bucket_map=self.bucket_map())

    def dead_actors(self) -> list[str]:
        return []  # everything runs in this process: a failure is an exception, not a death

    def recover(self, chain: list[CheckpointRef]) -> dict[str, Any] | None:
        raise RuntimeError("the in-process runtime has no processes to replace")

    def failovers(self) -> list[dict[str, Any]]:
        return []

    def shutdown(self) -> None:
        self.trainer.shutdown()


class RayRuntime(RuntimeBase):
    """Shards and trainers as Ray actors; dense allreduce through torch.distributed among the trainers.

    Failure handling (`recover`): trainers are all replaced (a survivor may be blocked in an allreduce
    with the dead one), dead shards are re-created, and every shard and trainer is restored from the
    given checkpoint chain, so the whole job continues from the last committed checkpoint. With
    ``fault_tolerance.shard_failover`` a dead shard is first rebuilt alone, in place, from its
    checkpoint file and its log (`psrec.elastic.shard_failover`), and a trainer that dies while training is
    replaced alone (`psrec.elastic.trainer_failover`); `recover` runs only when that fails.
    """

    def __init__(self, config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> None:
        import ray

        self.config = config
        # strategy "collective": no shard actors, every trainer holds a partition of the tables.
        self.collective = config.ps.strategy == "collective"
        if self.collective:
            builders.collective_placement(
                config, config.ps.num_trainers
            )  # a plan that does not fit fails here
        self._owns_ray = not ray.is_initialized()
        start_ray(config.ps.address, **ray_start_arguments(config))  # unless it runs already
        available = ray.cluster_resources().get("CPU", 0.0)
        if required_cpus(config) > available:
            raise ConfigError(
                f"ps: {config.ps.num_trainers} trainers x {config.ps.trainer_resources.num_cpus} CPU + "
                f"{config.ps.num_shards} shards x {config.ps.shard_resources.num_cpus} CPU = {required_cpus(config)} "
                f"CPUs, but the Ray cluster has {available}: lower ps.*_resources.num_cpus or add nodes"
            )
        gpus = config.ps.num_trainers * config.ps.trainer_resources.num_gpus
        if gpus > ray.cluster_resources().get("GPU", 0.0):
            raise ConfigError(
                f"ps: {config.ps.num_trainers} trainers x {config.ps.trainer_resources.num_gpus} GPU = {gpus} "
                f"GPUs, but the Ray cluster has {ray.cluster_resources().get('GPU', 0.0)}: add GPU nodes, "
                "or set ps.trainer_resources.num_gpus: 0 and training.device: cpu"
            )
        self._base_dir = base_dir
        self._data_sources = data_sources
        self._lr_factor = 1.0
        self._shard_tables = builders.shard_table_specs(config, partitions=config.ps.num_shards)
        # fault_tolerance.shard_failover: Ray restarts a dead shard in place and it replays its log
        self._failover = ShardFailover.for_run(config)
        self._shard_class = (
            self._failover.actor_class(ShardActor) if self._failover else ray.remote(ShardActor)
        )
        self._trainer_class = ray.remote(TrainerWorker)
        self._trainer_group = placement.TrainerGroup(
            config.ps.trainer_resources,
            strategy=config.ps.placement.trainers,
            node_resource=config.ps.placement.trainer_node_resource,
            timeout=placement.PLACEMENT_GROUP_TIMEOUT_S,
        )
        self.placement: dict[str, Any] = {}
        self.shards: list[Any] = []
        self.trainers: list[Any] = []
        self.trainer_group = ActorGroup(lambda: self.trainers, on_ray=True)
        # a shard being restarted (shard failover) is sent its call again once it is back
        self.shard_group: ActorGroup[ShardActor] = ActorGroup(
            lambda: self.shards, on_ray=True, resend=self._failover is not None
        )
        self.partitions = (
            Partitions(self.trainer_group, held_by="trainers")
            if self.collective
            else Partitions(self.shard_group, held_by="shard_actors")
        )
        # trainer failover: each trainer's place at the last step boundary, attempts, reports
        self.cursors = [trainer_failover.Cursor(0, 0, None) for _ in range(config.ps.num_trainers)]
        self._failover_attempts = 0
        self._trainer_failovers: list[dict[str, Any]] = []
        self._trainer_options: list[dict[str, Any]] = []
        try:
            if not self.collective:
                self.shards = [self.start_shard(i) for i in range(config.ps.num_shards)]
            self._start_trainers()
        except BaseException:
            self.shutdown()
            raise

    def start_shard(self, index: int) -> Any:
        """A new actor for shard `index`, placed as the config says (not yet answering)."""
        ps = self.config.ps
        options = placement.actor_options(
            ps.shard_resources,
            strategy=ps.placement.shards,
            node_resource=ps.placement.shard_node_resource,
        )
        return self._shard_class.options(**options).remote(
            index,
            self._shard_tables,
            num_trainers=builders.pushing_trainers(self.config),
            mode=ps.mode,
            wire_precision=ps.wire_precision,
            threads=ps.shard_resources.threads,
            **(self._failover.shard_options(index) if self._failover else {}),
        )

    def _start_trainers(self) -> None:

        ps = self.config.ps
        self._trainer_options = self._trainer_group.start(ps.num_trainers)
        self.trainers = [self.start_trainer(i) for i in range(ps.num_trainers)]
        self.shard_group.within(300).call(ShardActor.pid)
        self.trainer_group.within(300).call(TrainerWorker.pid)
        self.report_placement()
        if ps.num_trainers > 1:
            self.form_group(None)

    # -- trainer failover (`psrec.elastic.trainer_failover.TrainerActors`) ---------------------------
    def start_trainer(self, index: int, config: RunConfig | None = None) -> Any:
        """A new actor for trainer `index`, in its place of the trainers' placement group; trainers
        added while training (`config`: the run's with the new trainer count) are placed by Ray."""
        routed = self.shards[: int(self.bucket_map().max()) + 1]  # shards a resharding added or kept
        routing = {"bucket_map": self._bucket_map, "routing_version": self._routing_version}
        ps = self.config.ps
        while len(self._trainer_options) <= index:
            self._trainer_options.append(
                placement.actor_options(
                    ps.trainer_resources, strategy="any", node_resource=ps.placement.trainer_node_resource
                )
            )
        return self._trainer_class.options(**self._trainer_options[index]).remote(
            config or self.config,
            index,
            routed,
            base_dir=self._base_dir,
            data_sources=self._data_sources,
            **routing,
        )

    def adopt_trainers(self, trainers: list[Any], config: RunConfig) -> None:
        """Train with `trainers` (handles, in rank order) under `config` (the trainer count changed
        while training, `psrec.elastic.trainer_scaling`)."""
        self.trainers, self.config = trainers, config
        del self._trainer_options[len(trainers) :]

    def form_group(self, timeout_s: float | None, join_timeout_s: float | None = None) -> None:
        """Every trainer joins a new process group (the dense allreduce), trainer 0 serving its store.
        When a trainer dies meanwhile, the others' calls are waited for (their wait to join fails
        after `join_timeout_s`) before the failure is raised: they answer calls again then."""
        import ray

        address, port = self.trainer_group.within(60).call_first(TrainerWorker.listen_for_group)
        refs = self.trainer_group.submit(
            TrainerWorker.init_process_group, address, port, timeout_s, join_timeout_s
        )
        try:
            gather(refs)
        except BaseException:
            if join_timeout_s is not None:
                ray.wait(refs, num_returns=len(refs), timeout=join_timeout_s + 30)
            raise

    def answers(self, actor: Any, timeout: float) -> bool:
        return answers(actor, timeout=timeout)

    def spend_restart(self) -> bool:
        spent = self._failover_attempts + len(self._failover.failovers() if self._failover else [])
        if spent >= self.config.fault_tolerance.max_restarts:
            return False
        self._failover_attempts += 1
        return True

    def record(self, report: dict[str, Any]) -> None:
        logger.warning("trainer failover: %s", report)
        self._trainer_failovers.append(report)
        self.report_placement()

    def train_steps(self, max_steps: int) -> list[ChunkResult]:
        # the config of now: a trainer count changed while training (`trainer_scaling`) decides too
        if trainer_failover.failover_refusal(self.config) is not None:
            return super().train_steps(max_steps)
        return trainer_failover.train_steps(self, max_steps)

    def start_epoch(self, epoch: int) -> None:
        super().start_epoch(epoch)
        self.cursors = [trainer_failover.Cursor(c.step, epoch, None) for c in self.cursors]

    def restore(self, chain: list[CheckpointRef]) -> dict[str, Any]:
        restored = super().restore(chain)
        self.cursors = [
            trainer_failover.Cursor(int(s["step"]), int(s["epoch"]), s["position"])
            for s in self.trainer_group.call(TrainerWorker.checkpoint_state)
        ]
        return restored

    # -- primitives ------------------------------------------------------------------------------
    @property
    def num_trainers(self) -> int:
        return len(self.trainers)

    def shard_set(self) -> ShardSet | None:
        """The shard actors as the resharding controller changes them (`psrec.elastic.shard_set`);
        None under strategy "collective" (the trainers hold the tables)."""
        return None if self.collective else RayShards(self)

    def _write_partitions(self, pending: PendingCheckpoint, kind: str) -> list[FileRecord]:
        if self.collective:
            return self.trainer_group.call(TrainerWorker.shard_write_checkpoint, pending, kind)
        return self.shard_group.call(ShardActor.write_checkpoint, pending, kind)

    def _restore_partitions(self, chain: list[CheckpointRef], step: int) -> None:
        if self.collective:
            self.trainer_group.call(TrainerWorker.shard_restore, chain, step)
        else:  # a chain of another shard count is resharded on the way in
            self.shard_group.call(ShardActor.restore, chain, step, self.bucket_map())

    def _checkpoint_committed(self, ref: CheckpointRef) -> None:
        if self._failover is not None:
            self._failover.committed(self.shards, ref)

    def failovers(self) -> list[dict[str, Any]]:
        shards = self._failover.failovers() if self._failover is not None else []
        return shards + self._trainer_failovers

    def failover_reports(self) -> list[dict[str, Any] | None]:
        """Each shard's log report: records and bytes logged, restores, how it was rebuilt (or None)."""
        return (
            self._failover.reports(self.shards) if self._failover is not None else [None] * len(self.shards)
        )

    def report_placement(self) -> None:
        """Where each actor landed: logged, kept for summary.json (`placement_report`)."""
        import ray

        shards = self.shard_group.within(60).call(ShardActor.location)
        trainers = self.trainer_group.within(60).call(TrainerWorker.location)
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        self.placement = placement.placement_report(
            self.config.ps.placement, shards=shards, trainers=trainers, nodes=alive
        )
        logger.info("%s", placement.describe(self.placement))

    # -- failures --------------------------------------------------------------------------------
    def dead_actors(self) -> list[str]:
        """Names of the actors that no longer answer (a failed call may be a symptom of one of them)."""
        named = [(f"trainer {i}", a) for i, a in enumerate(self.trainers)]
        named += [(f"shard {i}", a) for i, a in enumerate(self.shards)]
        return [name for name, actor in named if not answers(actor, timeout=5.0)]

    def recover(self, chain: list[CheckpointRef]) -> dict[str, Any] | None:
        """Replace dead actors and roll every shard and trainer back to `chain` (or to a fresh start)."""
        import ray

        settle_lost_actors([*self.trainers, *self.shards])  # replacements must not land on a dying node
        for trainer in self.trainers:
            ray.kill(trainer)
        dead = [i for i, shard in enumerate(self.shards) if not answers(shard)]
        logger.warning("recovering: re-creating trainers and shards %s", dead)
        if not chain:  # nothing committed yet: start over with fresh tables everywhere
            dead = list(range(len(self.shards)))
        for index in dead:
            ray.kill(self.shards[index])
            if self._failover is not None:  # it is restored from the checkpoint, not its log
                self._failover.forget(index)
            self.shards[index] = self.start_shard(index)
        self._start_trainers()
        if not chain:
            self._lr_factor = 1.0
            return None
        return self.restore(chain)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for trainer in self.trainers:
            with contextlib.suppress(Exception):  # best effort: the actor is killed next
                ray.get(trainer.shutdown.remote(), timeout=10)  # one at a time: each may hang
        for actor in [*self.trainers, *self.shards]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        unlink_job_segments(ray.get_runtime_context().get_job_id())  # a killed trainer's, on this machine
        self._trainer_group.remove()
        failover = getattr(self, "_failover", None)
        if failover is not None:
            failover.close()
        if self._owns_ray:
            stop_ray()


def make_runtime(config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> Runtime:
    if config.ps.runtime == "local":
        return LocalRuntime(config, base_dir=base_dir, data_sources=data_sources)
    return RayRuntime(config, base_dir=base_dir, data_sources=data_sources)
