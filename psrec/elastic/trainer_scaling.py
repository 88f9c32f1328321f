"""Changing the trainer count while training: ``psrec scale RUN_DIR --trainers N``, the driver's side.

The request travels as a shard-count request does (`psrec.elastic.resharding`: ``scale-request.json``,
``scale.json``, the controller polled between chunks of steps) and carries ``"trainers": N``. On
the Ray runtime, under strategy "ps" without a pipeline, sync or async mode, `TrainerChange` then:

1. starts the added trainer actors (growing) without waiting for them: training goes on meanwhile;
2. at the first step boundary where they answer (at once when shrinking), switches: every trainer's
   position, then the rest of the epoch's data dealt to N trainers (`psrec.data.shares`: every row
   not yet trained on goes to exactly one new trainer); the trainers left over stop; each trainer
   of the new set leaves the old process group, loads trainer 0's dense replica (model, optimizer
   state, snapshots: identical on every trainer after each step's allreduce) and opens its new
   share (`TrainerWorker.rescale`, `TrainerWorker.take_over`); every shard expects N pushes per sync
   step; the dense allreduce group is formed again with world size N.

No pull or push is in flight at a boundary, so nothing is lost or applied twice. From the switch on
a step is N trainers' batches: the global batch is ``training.batch_size`` x N, so the model differs
from a run that kept the old count; it equals, bit for bit, a run that checkpoints at that step and
resumes with ``ps.num_trainers=N`` (a checkpoint restores into any trainer count: `dealt_states`).
Checkpoints written after the switch record N trainers' positions; resuming with any
``ps.num_trainers`` deals the rest of the epoch again.

Refused, with nothing changed: a count below 1 or one the Ray cluster has no free CPUs for, the
in-process runtime (one trainer), strategy "collective" and a pipeline. With
``fault_tolerance.shard_failover`` each shard logs its new trainer count like any other change
(`psrec.ps.replay`), so a shard rebuilt after the switch completes its steps with the new count.
The decisions (`config_refusal`, `count_error`, `dealt_states`) are pure functions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from psrec.cluster.groups import ActorGroup, RemoteCall, gather
from psrec.config import RunConfig
from psrec.data.kafka_source import is_kafka_position, merge_positions
from psrec.data.shares import redistribute
from psrec.elastic.runtime_api import RayActorsRuntime
from psrec.elastic.shard_set import all_answered
from psrec.ps.shard import ParameterShard
from psrec.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # added trainer actors that do not answer by then: the request is refused


def with_trainers(config: RunConfig, count: int) -> RunConfig:
    """`config` with ``ps.num_trainers`` set to `count`."""
    return config.model_copy(update={"ps": config.ps.model_copy(update={"num_trainers": count})})


def config_refusal(*, runtime: str, strategy: str, pipeline: bool) -> str | None:
    """Why a run with these settings cannot change its trainer count while training, or None."""
    if runtime != "ray":
        return (
            "the in-process runtime runs one trainer: train with ps.runtime 'ray' to change the trainer "
            "count while training"
        )
    if strategy == "collective":
        return (
            "strategy 'collective' partitions the tables over the trainers: their count is fixed for the run"
        )
    if pipeline:
        return "ps.pipeline splits the dense model over a fixed number of trainers: the count cannot change"
    return None


def refusal_of(config: RunConfig) -> str | None:
    ps = config.ps
    return config_refusal(
        runtime=ps.runtime,
        strategy=ps.strategy,
        pipeline=ps.pipeline is not None,
    )


def refusal_of_json(config: dict[str, Any]) -> str | None:
    """`refusal_of` over the run's config.json."""
    ps = config.get("ps", {})
    return config_refusal(
        runtime=ps.get("runtime", "ray"),
        strategy=ps.get("strategy", "ps"),
        pipeline=ps.get("pipeline") is not None,
    )


def count_error(count: Any, *, current: int, free_cpus: float | None, cpus_per_trainer: float) -> str | None:
    """Why `count` trainers cannot be had now (None: it can). `free_cpus` None: not checked."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return f"trainers must be an integer >= 1, got {count!r}"
    added = max(0, count - current) * cpus_per_trainer
    if free_cpus is not None and added > free_cpus:
        return (
            f"{count} trainers need {added:g} more CPUs (ps.trainer_resources.num_cpus {cpus_per_trainer:g} "
            f"each) but the Ray cluster has {free_cpus:g} free: add nodes or lower ps.trainer_resources.num_cpus"
        )
    return None


def capacity_error(runtime: RayActorsRuntime, request: dict[str, Any], shards: int) -> str | None:
    """Why the trainer count of `request` cannot be had on `runtime`'s Ray cluster now (the CPUs of
    the shards it adds counted first; `shards`: the shard count now), or None."""
    import ray

    ps = runtime.config.ps
    free = float(ray.available_resources().get("CPU", 0.0))
    wanted_shards = request.get("shards")
    if isinstance(wanted_shards, int) and not isinstance(wanted_shards, bool):
        free -= max(0, wanted_shards - shards) * ps.shard_resources.num_cpus
    error = count_error(
        request.get("trainers"),
        current=len(runtime.trainers),
        free_cpus=free,
        cpus_per_trainer=ps.trainer_resources.num_cpus,
    )
    return None if error is None else f"scale request trainers: {error}"


def dealt_states(states: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`count` trainers' states (step, epoch, reader position) that go on where the trainers at
    `states` stood, the rest of their epoch dealt to them (`psrec.data.shares.redistribute`)."""
    if len(states) == count:
        return states
    steps = {int(state["step"]) for state in states}
    epochs = {int(state["epoch"]) for state in states}
    if len(steps) != 1 or len(epochs) != 1:
        raise ValueError(
            f"the trainers stood at different steps {sorted(steps)} or epochs {sorted(epochs)}: their data "
            "cannot be dealt to another trainer count"
        )
    step, epoch = steps.pop(), epochs.pop()
    positions = [state.get("position") for state in states]
    if all(position is None for position in positions):  # no epoch opened yet
        dealt: list[Any] = [None] * count
    elif any(position is None for position in positions):
        raise ValueError("some trainers have no reader position: their data cannot be dealt")
    elif all(is_kafka_position(position) for position in positions):  # each reads its partitions' offsets
        dealt = [merge_positions([p for p in positions if p is not None])] * count
    else:
        dealt = redistribute([position for position in positions if position is not None], count)
    return [
        {"trainer": index, "step": step, "epoch": epoch, "position": position}
        for index, position in enumerate(dealt)
    ]


class TrainerChange:
    """One change of a `RayRuntime`'s trainer count (see the module docstring): `start`, then
    `advance` at each boundary until it has switched (or refused)."""

    def __init__(self, runtime: RayActorsRuntime, count: int) -> None:
        self.runtime = runtime
        self.count = count
        self.config = with_trainers(runtime.config, count)
        self._starting: list[Any] = []
        self._answers: list[Any] = []
        self._started_at = time.monotonic()

    def start(self) -> None:
        """Start the added trainers' actors (growing); does not wait for them."""
        self._started_at = time.monotonic()
        first = len(self.runtime.trainers)
        self._starting = [
            self.runtime.start_trainer(index, self.config) for index in range(first, self.count)
        ]
        self._answers = [RemoteCall(trainer, TrainerWorker.pid).send() for trainer in self._starting]

    def ready(self) -> bool:
        return all_answered(self._answers)  # a trainer that failed to start raises here

    def advance(self, step: int) -> tuple[str, dict[str, Any] | str | None]:
        """At a step boundary: ("waiting", None) while the added trainers start, ("refused", why) when
        they fail or time out (they are killed), else switch here: ("switched", what to report).
        A failure during the switch kills the trainers not switched to and raises."""
        try:
            ready = self.ready()
        except Exception as error:  # noqa: BLE001 - an added trainer that died while starting
            self.abandon()
            return "refused", f"an added trainer failed to start: {error}"
        if not ready:
            if time.monotonic() - self._started_at <= START_TIMEOUT_S:
                return "waiting", None
            self.abandon()
            return "refused", f"the added trainers did not start within {START_TIMEOUT_S:.0f} s"
        report: dict[str, Any] = {"start_seconds": time.monotonic() - self._started_at}  # request -> answer
        try:
            report["switch"] = {"step": step, **self.switch()}
        except BaseException:
            self.abandon()
            raise
        logger.info(
            "step %d: training on %d trainers (%.3f s pause)", step, self.count, report["switch"]["seconds"]
        )
        return "switched", report

    def switch(self) -> dict[str, Any]:
        """At a step boundary: deal the data, stop the trainers left over, give every trainer of the
        new set trainer 0's replica and its share, set the shards' count, form the group again.
        Returns the seconds of each part."""
        import ray

        from psrec.elastic.trainer_failover import Cursor

        runtime, count = self.runtime, self.count
        began = time.perf_counter()
        states = runtime.trainer_group.call(TrainerWorker.checkpoint_state)
        dealt = dealt_states(states, count)
        replica = RemoteCall(runtime.trainers[0], TrainerWorker.replica_state).send()
        kept, removed = runtime.trainers[:count], runtime.trainers[count:]
        trainers = [*kept, *self._starting]
        new_group: ActorGroup[TrainerWorker] = ActorGroup(lambda: trainers, on_ray=True)
        new_group.within(120).call(TrainerWorker.rescale, self.config)
        for trainer in removed:  # they left the old group: nothing waits on them any more
            try:
                ray.get(RemoteCall(trainer, TrainerWorker.shutdown).send(), timeout=30)
            except Exception as error:  # noqa: BLE001 - it is killed next whatever it says
                logger.warning("a removed trainer did not shut down cleanly: %s", error)
            ray.kill(trainer)
        runtime.adopt_trainers(trainers, self.config)
        self._starting, self._answers = [], []
        dealt_at = time.perf_counter()
        takeovers = [
            RemoteCall(
                trainer,
                TrainerWorker.take_over,
                (replica,),
                {"step": state["step"], "epoch": state["epoch"], "position": state["position"], "skip": 0},
            ).send()
            for trainer, state in zip(trainers, dealt, strict=True)
        ]
        gather(takeovers, timeout=300)
        runtime.cursors = [Cursor(int(s["step"]), int(s["epoch"]), s["position"]) for s in dealt]
        replicas_at = time.perf_counter()
        if runtime.shards:
            runtime.partitions.call(ParameterShard.set_num_trainers, count)
        if count > 1:
            runtime.form_group(None)
        grouped_at = time.perf_counter()
        runtime.report_placement()
        return {
            "seconds": grouped_at - began,
            "deal_seconds": dealt_at - began,
            "replica_seconds": replicas_at - dealt_at,
            "group_seconds": grouped_at - replicas_at,
        }

    def abandon(self) -> None:
        """Kill the added trainers not switched to (the request was refused or the run ended)."""
        import ray

        for trainer in self._starting:
            ray.kill(trainer)
        self._starting, self._answers = [], []
