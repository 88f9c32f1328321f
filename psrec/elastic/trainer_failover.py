"""Trainer failover on Ray: a dead trainer is replaced alone, the job goes on without a rollback.

With ``fault_tolerance.trainer_failover`` (and ``shard_failover``, sync mode, strategy "ps", two
or more trainers) a trainer that dies during a chunk of steps costs no rollback:

1. the driver waits until every trainer's call of the chunk has ended (the survivors' dense
   allreduce fails once the dead trainer's sockets close);
2. each survivor leaves the broken process group and hands over the steps it completed and where
   they left it (`TrainerWorker.abort_chunk`): in sync mode every survivor completed the same steps
   `T` (the allreduce is a barrier), and its dense replica is the model after step `T`;
3. a new trainer of the same index copies a survivor's dense replica (model, optimizer state,
   snapshots) and opens the dead trainer's reader where it stood at the chunk's start (the driver
   keeps each trainer's position at every chunk's end: `ChunkResult.state`), reading past the batches
   of the steps up to `T` (`TrainerWorker.take_over`);
4. the group is formed again and the chunk's remaining steps run; the dead trainer's unfinished step
   `T + 1` is the only one computed twice, by every trainer. The shards are untouched: a push they
   already hold is dropped by its request id, and a training pull sent again (numbered by its step
   under the trainer's name) is answered with the rows its first copy got
   (`psrec.ps.replay.LoggedShard.pull`), so the repeated step computes what it computed the first
   time, even when a shard applied the step meanwhile.

So no update is lost or applied twice, every row is consumed once, and the run ends with the
undisturbed run's model. A second death during the replacement starts it over (each attempt spends
one of ``fault_tolerance.max_restarts``; a death while the group forms again holds the survivors
up to `JOIN_TIMEOUT_S` in their wait to join). Whatever this cannot handle (one trainer, async mode,
survivors that disagree on `T`, a dead shard at the same time, a survivor that does not return)
re-raises the failure, and the driver rolls the whole job back as before.

The decisions (`failover_refusal`, `common_step`, `merge_chunks`) are pure functions; `train_steps`
is the machinery around the runtime's actors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from psrec.cluster.groups import RemoteCall, gather
from psrec.config import RunConfig
from psrec.trainer.chunks import ChunkResult
from psrec.trainer.worker import TrainerWorker

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 120.0  # how long the survivors' calls may take to end after a trainer died
GROUP_TIMEOUT_S = 300.0  # the re-formed group's collectives (a death fails them)
# The wait to join the re-formed group: every trainer is idle then, so the group forms in seconds;
# a trainer that dies meanwhile holds the others up this long before the failover starts over.
JOIN_TIMEOUT_S = 30.0


def failover_refusal(config: RunConfig) -> str | None:
    """Why a dead trainer of this run rolls the job back instead (None: it is replaced alone)."""
    settings, ps = config.fault_tolerance, config.ps
    if not settings.trainer_failover:
        return "fault_tolerance.trainer_failover is off"
    if not settings.shard_failover:
        return "the shards keep no log (fault_tolerance.shard_failover) to repeat a step against"
    if ps.runtime != "ray" or ps.strategy != "ps" or ps.pipeline is not None:
        return "only strategy 'ps' on Ray without a pipeline replaces one trainer"
    if ps.mode != "sync":
        return "async trainers stand at different steps: no survivor holds the dead one's replica"
    if ps.num_trainers < 2:
        return "one trainer: no survivor holds the dense replica"
    if config.training.mode == "continuous":
        return (
            "a continuous run's batches depend on when events arrived: a dead trainer's steps are not "
            "repeated by count, the job rolls back to its checkpoint's stream offsets"
        )
    return None


class NoFailover(Exception):
    """The trainers' state does not allow replacing the dead one alone (the job rolls back)."""


def common_step(states: list[dict[str, Any]]) -> int:
    """The step every survivor completed; they must agree (sync mode), else NoFailover."""
    steps = sorted({int(state["step"]) for state in states})
    if len(steps) != 1:
        raise NoFailover(f"the survivors stopped at different steps {steps}")
    return steps[0]


def merge_chunks(parts: list[ChunkResult], *, max_steps: int) -> ChunkResult:
    """One trainer's parts of a chunk (before, between and after failovers) as the chunk's result."""
    last = parts[-1]
    steps = sum(part.steps for part in parts)
    phases: dict[str, float] = {}
    input_counts: dict[str, int] = {}
    for part in parts:
        for key, value in part.phase_seconds.items():
            phases[key] = phases.get(key, 0.0) + value
        for key, count in part.input_counts.items():
            input_counts[key] = input_counts.get(key, 0) + count
    started = [part.first_step_at for part in parts if part.first_step_at is not None]
    return ChunkResult(
        steps=steps,
        samples=sum(part.samples for part in parts),
        loss_sum=sum(part.loss_sum for part in parts),
        scores=np.concatenate([part.scores for part in parts]),
        labels=np.concatenate([part.labels for part in parts]),
        row_ids=np.concatenate([part.row_ids for part in parts]),
        exhausted=steps < max_steps,
        phase_seconds=phases,
        bytes_pulled=sum(part.bytes_pulled for part in parts),
        bytes_pushed=sum(part.bytes_pushed for part in parts),
        input_counts=input_counts,
        failed_units=[unit for part in parts for unit in part.failed_units],
        first_step_at=min(started) if started else None,
        state=last.state,
        stream=last.stream,
    )


@dataclass
class Cursor:
    """Where a trainer stood at the driver's last step boundary: its step, epoch and reader position."""

    step: int
    epoch: int
    position: Any


class TrainerActors(Protocol):
    """What `train_steps` needs of the Ray runtime."""

    trainers: list[Any]
    shards: list[Any]
    cursors: list[Cursor]

    def start_trainer(self, index: int) -> Any: ...

    def form_group(self, timeout_s: float | None, join_timeout_s: float | None = None) -> None: ...

    def answers(self, actor: Any, timeout: float) -> bool: ...

    def spend_restart(self) -> bool:
        """Take one of the run's restarts for a failover attempt; False when none is left."""
        ...

    def record(self, report: dict[str, Any]) -> None: ...


def train_steps(runtime: TrainerActors, max_steps: int) -> list[ChunkResult]:
    """`TrainerWorker.train_steps(max_steps)` on every trainer, replacing a trainer that dies."""
    import ray
    from ray.exceptions import RayError

    parts: list[list[ChunkResult]] = [[] for _ in runtime.trainers]
    remaining = max_steps
    while True:
        refs = [
            RemoteCall(trainer, TrainerWorker.train_steps, (remaining,)).send()
            for trainer in runtime.trainers
        ]
        try:
            results = ray.get(refs)
            break
        except RayError as error:
            died_at = time.time()
            ray.wait(refs, num_returns=len(refs), timeout=SETTLE_TIMEOUT_S)
            done = _finished(refs)
            if len(done) + _ended_with_error(refs) < len(refs):
                raise  # a survivor is stuck: the rollback kills it
            for index, result in done.items():  # chunks that ended before the death was felt
                parts[index].append(result)
                _advance(runtime, index, result)
            try:
                steps = _replace_dead(runtime, parts, died_at)
            except NoFailover as reason:
                logger.warning("trainer failover not possible (%s): rolling back", reason)
                raise error from None
            remaining = max_steps - steps
    for index, result in enumerate(results):
        parts[index].append(result)
        _advance(runtime, index, result)
    return [merge_chunks(trainer_parts, max_steps=max_steps) for trainer_parts in parts]


def _finished(refs: list[Any]) -> dict[int, ChunkResult]:
    import ray

    done = {}
    for index, ref in enumerate(refs):
        try:
            done[index] = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - failed or still running: not a finished chunk
            continue
    return done


def _ended_with_error(refs: list[Any]) -> int:
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    count = 0
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - counted
            count += 1
    return count


def _advance(runtime: TrainerActors, index: int, result: ChunkResult) -> None:
    if result.state is not None:
        state = result.state
        runtime.cursors[index] = Cursor(int(state["step"]), int(state["epoch"]), state["position"])


def _replace_dead(runtime: TrainerActors, parts: list[list[ChunkResult]], died_at: float) -> int:
    """Replace every dead trainer (again, when one dies meanwhile); returns the chunk's steps done."""
    import ray
    from ray.exceptions import RayError

    while True:
        if not runtime.spend_restart():
            raise NoFailover("fault_tolerance.max_restarts reached")
        if not all(runtime.answers(shard, 10.0) for shard in runtime.shards):
            raise NoFailover("a shard died too")
        dead = [i for i, trainer in enumerate(runtime.trainers) if not runtime.answers(trainer, 5.0)]
        survivors = [i for i in range(len(runtime.trainers)) if i not in dead]
        if not dead:
            raise NoFailover("every trainer answers: the failure was not a death")
        if not survivors:
            raise NoFailover("no trainer survived")
        logger.warning("trainers %s died: replacing them alone from trainer %d", dead, survivors[0])
        try:
            handed = gather(
                [RemoteCall(runtime.trainers[i], TrainerWorker.abort_chunk).send() for i in survivors], 120
            )
            for index, hand in zip(survivors, handed, strict=True):
                parts[index].append(hand["partial"])
                state = hand["state"]
                runtime.cursors[index] = Cursor(int(state["step"]), int(state["epoch"]), state["position"])
            step = common_step([hand["state"] for hand in handed])
            chunk_steps = sum(part.steps for part in parts[survivors[0]])
            replica = RemoteCall(runtime.trainers[survivors[0]], TrainerWorker.replica_state).send()
            for index in dead:
                ray.kill(runtime.trainers[index])
                cursor = runtime.cursors[index]
                runtime.trainers[index] = runtime.start_trainer(index)
                takeover = RemoteCall(
                    runtime.trainers[index],
                    TrainerWorker.take_over,
                    (replica,),
                    {
                        "step": step,
                        "epoch": cursor.epoch,
                        "position": cursor.position,
                        "skip": step - cursor.step,
                    },
                )
                partial = ray.get(takeover.send(), timeout=300)
                parts[index].append(partial)
                _advance(runtime, index, partial)
            runtime.form_group(GROUP_TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S)
        except (RayError, TimeoutError) as error:  # another death during the replacement: again
            logger.warning("a trainer died during the failover (%s): starting it again", error)
            continue
        runtime.record(
            {
                "trainers": dead,
                "step": step,
                "steps_into_chunk": chunk_steps,
                "died": died_at,
                "ready": time.time(),
                "seconds": time.time() - died_at,
            }
        )
        return chunk_steps
