"""Typed calls from the driver to a group of actors (trainers or shards), in this process or on Ray.

A call names the method itself, never a string: ``trainers.call(TrainerWorker.start_epoch, epoch)``
is checked by mypy against `TrainerWorker.start_epoch`'s signature and returns one answer per member,
in the members' order. The members are plain objects (the in-process runtime) or Ray actor handles
(the Ray runtime); that difference is written once, here (`ActorGroup._send`), and every caller is the
same for both::

    trainers = ActorGroup(lambda: runtime.trainers, on_ray=True)
    trainers.call(TrainerWorker.start_epoch, 0)             # every trainer, together; [None, None]
    trainers.call_each(TrainerWorker.restore, [(dense, s) for s in states])  # one argument tuple each
    trainers.within(60).call(TrainerWorker.location)        # a deadline for these calls

`Partitions` is the group of table partitions: `ParameterShard` objects in process, shard actors on
Ray (their maintenance calls go through `ShardActor.call`, which logs them for replay), or each
trainer's local partition under strategy "collective" (`TrainerWorker.shard_call`):
``partitions.call(ParameterShard.stats)``.

With ``resend`` (shard failover), a call that a shard Ray is restarting did not answer is sent again
once the shard is back (`answered_refs`); such calls must be idempotent, as the driver's are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

if TYPE_CHECKING:
    from psrec.ps.shard import ParameterShard

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M")


def gather(refs: list[Any], timeout: float | None = None) -> list[Any]:
    """The answers of Ray calls `refs`, raising as soon as any call fails (``ray.get(list)`` may first
    wait on a blocked one) and `TimeoutError` when one has not answered within `timeout` seconds."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError(f"{len(pending)} actor calls did not answer within {timeout} s")
        ray.get(ready)  # raises the call's error, if any
    return ray.get(list(refs))


def answers(actor: Any, timeout: float = 10.0) -> bool:
    """Whether the Ray actor answers a call within `timeout` seconds (any failure: it does not)."""
    import ray

    try:
        ray.get(actor.pid.remote(), timeout=timeout)
    except Exception:  # noqa: BLE001 - any failure means the actor must be replaced
        return False
    return True


@dataclass(frozen=True)
class RemoteCall:
    """``method(actor, *args, **kwargs)`` on a Ray actor: `method` is the actor class's own method
    (``ShardActor.export_buckets``), so the call names what it runs, checked by mypy's eye and grep."""

    actor: Any
    method: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def send(self) -> Any:
        """The call sent; its Ray ref."""
        return getattr(self.actor, self.method.__name__).remote(*self.args, **self.kwargs)


def answered_refs(calls: Sequence[RemoteCall]) -> list[Any]:
    """Each of `calls`, sent in parallel; returns, once every call has answered, the refs of their
    answers (to pass on to other actors without fetching them). A call that a restarting actor did
    not answer is sent again once it is back (the calls must be idempotent); one to an actor dead for
    good raises `RayActorError`, any other error its own."""
    import ray
    from ray.exceptions import RayActorError

    from psrec.ps.actors import RESEND_ATTEMPTS, restarting

    refs = [call.send() for call in calls]
    for index, call in enumerate(calls):
        for attempt in range(RESEND_ATTEMPTS + 1):
            try:
                ray.get(refs[index])  # raises the call's error
                break
            except RayActorError as error:
                if attempt == RESEND_ATTEMPTS or not restarting(call.actor, error):
                    raise
                logger.warning("actor unavailable: sending %s again once it is back", call.method.__name__)
                refs[index] = call.send()
    return refs


def answered(calls: Sequence[RemoteCall]) -> list[Any]:
    """The answers of `calls`, each sent again to an actor Ray restarted meanwhile (`answered_refs`)."""
    import ray

    return list(ray.get(answered_refs(calls)))


class ActorGroup(Generic[M]):
    """The members of one class `M`, called together (see the module docstring).

    `members` returns the current members (the runtime's list, which failover and scaling change);
    `on_ray`: they are Ray actor handles; `timeout`: seconds to wait for the answers (None: no limit);
    `resend`: send a call again to a member Ray restarted (`answered_refs`)."""

    def __init__(
        self,
        members: Callable[[], Sequence[Any]],
        *,
        on_ray: bool,
        timeout: float | None = None,
        resend: bool = False,
    ) -> None:
        self._members = members
        self.on_ray = on_ray
        self.timeout = timeout
        self.resend = resend

    def __len__(self) -> int:
        return len(self._members())

    def within(self, timeout: float | None) -> ActorGroup[M]:
        """The same group, its calls waited for at most `timeout` seconds."""
        return ActorGroup(self._members, on_ray=self.on_ray, timeout=timeout, resend=self.resend)

    def only(self, indexes: Sequence[int]) -> ActorGroup[M]:
        """The members at `indexes` (in that order), as a group of their own."""
        members = self._members
        return ActorGroup(
            lambda: [members()[i] for i in indexes],
            on_ray=self.on_ray,
            timeout=self.timeout,
            resend=self.resend,
        )

    def call(self, method: Callable[Concatenate[M, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method(member, *args, **kwargs)`` on every member, together; the answers in order."""
        return self._answers(self.submit(method, *args, **kwargs))

    def call_first(self, method: Callable[Concatenate[M, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method`` on the first member only; its answer."""
        return self.only([0]).call(method, *args, **kwargs)[0]

    def call_each(self, method: Callable[..., R], arguments: Sequence[tuple[Any, ...]]) -> list[R]:
        """``method(member_i, *arguments[i])`` on every member i, together; the answers in order."""
        members = self._members()
        if len(arguments) != len(members):
            raise ValueError(f"{len(arguments)} argument tuples for {len(members)} members")
        return self._answers(
            [self._send(m, method, args, {}) for m, args in zip(members, arguments, strict=True)]
        )

    def submit(self, method: Callable[Concatenate[M, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        """The calls sent, not waited for: Ray refs on Ray (see `gather`), the answers in process."""
        members = self._members()
        if self.on_ray and self.resend:
            return answered_refs([RemoteCall(member, method, args, kwargs) for member in members])
        return [self._send(member, method, args, kwargs) for member in members]

    def _send(
        self, member: Any, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The one place where a call in process and a call to a Ray actor differ."""
        if self.on_ray:
            return RemoteCall(member, method, args, kwargs).send()
        return method(member, *args, **kwargs)

    def _answers(self, sent: list[Any]) -> list[Any]:
        return gather(sent, self.timeout) if self.on_ray else sent


class Partitions:
    """The table partitions, whatever holds them (see the module docstring): ``call(method, ...)``
    runs a `ParameterShard` maintenance method on every partition; the answers in partition order."""

    def __init__(self, holders: ActorGroup[Any], *, held_by: str) -> None:
        if held_by not in ("process", "shard_actors", "trainers"):
            raise ValueError(
                f"partitions are held by 'process', 'shard_actors' or 'trainers', not {held_by!r}"
            )
        self.holders = holders
        self.held_by = held_by

    def call(
        self, method: Callable[Concatenate[ParameterShard, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        if self.held_by == "process":
            return self.holders.call(method, *args, **kwargs)
        from psrec.ps.actors import ShardActor
        from psrec.trainer.worker import TrainerWorker

        if kwargs:
            raise TypeError("maintenance calls to shard actors take positional arguments only")
        # the method itself travels (pickled by reference); a shard actor checks it is one of
        # ParameterShard's maintenance methods and logs its name for replay (`psrec.ps.replay`)
        if self.held_by == "shard_actors":
            return self.holders.call(ShardActor.call, method, *args)
        return self.holders.call(TrainerWorker.shard_call, method, *args)
