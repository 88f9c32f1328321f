"""Ray actors for the parameter server, and the connection the trainer-side client uses.

`ShardActor` builds its tables from plain `TableSpec`s inside its own process and wraps a
`ParameterShard`; `RayConnection` adapts an actor handle to the client's `ShardConnection`
protocol. NumPy arrays travel zero-copy through Ray's object store (they arrive read-only).

Shard failover: a `ShardActor` given a ``push_log`` directory logs every operation that changes it
(`psrec.ps.replay`), and one created again on the same directory (Ray restarts the actor in place
when it was created with ``max_restarts``) rebuilds the shard from its checkpoint file and the log
before it answers. `RayConnection` sends the calls that a dying shard did not answer again, in
their original order, once the shard is back (`ActorUnavailableError`: Ray is restarting it); the
shard drops or answers what it had already done, so the caller waits and nothing is lost or doubled.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from psrec.checkpoint import CheckpointRef, FileRecord, PendingCheckpoint
from psrec.embedding import TableSpec, build_table, warmup
from psrec.ps import bucket_move
from psrec.ps.client import Pending
from psrec.ps.replay import LoggedShard, announce_recovery
from psrec.ps.shard import ParameterShard, TableGradients
from psrec.ps.shard_checkpoint import restore_shard, write_shard_checkpoint
from psrec.ps.shared_arrays import (
    Message,
    ReplySpace,
    SegmentPool,
    SharedArrays,
    SharedMemoryUnavailable,
    job_prefix,
)
from psrec.ps.wire import check_precision, decode_gradients, encode_rows
from psrec.threads import set_thread_counts

logger = logging.getLogger(__name__)

# ParameterShard's maintenance methods a driver may run on a shard (`ShardActor.call`).
MAINTENANCE_METHODS = frozenset(
    {
        "stats",
        "evict",
        "save_snapshot",
        "restore_snapshot",
        "set_learning_rate",
        "set_num_trainers",
        "table_rows",
        "confirm_checkpoint",
        "record_versions",
        "version_log",
    }
)


def maintenance_name(method: Callable[..., Any]) -> str:
    """The name of `method` when it is one of ParameterShard's `MAINTENANCE_METHODS`, else ValueError."""
    name = getattr(method, "__name__", "")
    if name not in MAINTENANCE_METHODS or getattr(ParameterShard, name, None) is not method:
        raise ValueError(f"not one of ParameterShard's maintenance methods: {method!r}")
    return name


@dataclass(frozen=True)
class SharedRequest:
    """A pull's ids in shared memory (table i's under key "i") and the space for its rows."""

    tables: list[str]
    ids: SharedArrays
    reply: ReplySpace

    def load(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        arrays = self.ids.load(copy=copy)
        return {name: arrays[str(i)] for i, name in enumerate(self.tables)}


@dataclass(frozen=True)
class SharedGradients:
    """A push's ids and float32 gradients in shared memory (table i's under "i/ids", "i/grads")."""

    tables: list[str]
    arrays: SharedArrays

    def load(self, *, copy: bool = True) -> TableGradients:
        arrays = self.arrays.load(copy=copy)
        return {name: (arrays[f"{i}/ids"], arrays[f"{i}/grads"]) for i, name in enumerate(self.tables)}


class ShardActor:
    """One PS shard process (created with `ray.remote(ShardActor).options(...).remote(...)`).

    ``num_trainers`` is the number of trainers whose pushes complete a sync step; ``wire_precision``
    the precision of the rows it sends back (`psrec.ps.wire`); ``push_log`` the directory of this
    shard's log (None: no log, no failover), fsynced per record with ``push_log_fsync``.
    """

    def __init__(
        self,
        shard_index: int,
        tables: list[TableSpec],
        *,
        num_trainers: int,
        mode: str,
        wire_precision: str = "fp32",
        threads: int = 1,
        push_log: str | None = None,
        push_log_fsync: bool = False,
    ) -> None:
        started = time.time()
        if push_log is not None:
            announce_recovery(Path(push_log))  # a restarted process: say who rebuilds the shard
        set_thread_counts(threads)
        check_precision(wire_precision)
        self.wire_precision = wire_precision
        warmup()
        self.shard = ParameterShard(
            shard_index,
            {spec.name: build_table(spec) for spec in tables},
            num_trainers=num_trainers,
            mode=mode,
        )
        self.logged: LoggedShard | None = None
        if push_log is not None:
            self.logged = LoggedShard.open(self.shard, Path(push_log), fsync=push_log_fsync, started=started)

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> dict[str, Any]:
        return actor_location()

    def pull(
        self,
        requests: dict[str, np.ndarray] | SharedRequest,
        train: bool,
        caller: str | None = None,
        request: int | None = None,
    ) -> dict[str, np.ndarray] | SharedArrays:
        """Rows of each table's ids; a training pull's (caller, request) number makes it idempotent.
        Ids sent in shared memory are answered there when the rows fit the space reserved."""
        reply: ReplySpace | None = None
        if isinstance(requests, SharedRequest):
            reply = requests.reply
            # a logged shard keeps its replies' ids and rows; an unlogged one nothing of the call
            requests = requests.load(copy=self.logged is not None)
            if self.logged is None and self.wire_precision == "fp32":
                placed = self._rows_space(requests, reply)
                if placed is not None:
                    shared, out = placed
                    self.shard.pull(requests, train=train, out=out)
                    return shared
        if self.logged is not None:
            rows = self.logged.pull(requests, train=train, caller=caller, request=request)
        else:
            rows = self.shard.pull(requests, train=train)
        encoded = {name: encode_rows(values, self.wire_precision) for name, values in rows.items()}
        written = reply.write(encoded) if reply is not None else None
        return encoded if written is None else written

    def prefetch(self, requests: dict[str, np.ndarray]) -> int:
        """Start reading a coming training pull's cold rows (`ParameterShard.prefetch`): changes no
        result, so it is neither logged nor numbered."""
        return self.shard.prefetch(requests)

    def push(
        self, trainer: int, request_id: int, step: int, gradients: TableGradients | SharedGradients
    ) -> bool:
        if isinstance(gradients, SharedGradients):  # a push held for a sync step's others is copied
            gradients = gradients.load(copy=not self.shard.applies_pushes_at_once)
        if self.logged is not None:  # logged as it arrived (wire precision), decoded when applied
            return self.logged.push(trainer, request_id, step, dict(gradients))
        decoded = {name: (ids, decode_gradients(grads)) for name, (ids, grads) in gradients.items()}
        return self.shard.push(trainer, request_id, step, decoded)

    def _rows_space(
        self, requests: dict[str, np.ndarray], reply: ReplySpace
    ) -> tuple[SharedArrays, dict[str, np.ndarray]] | None:
        """Float32 rows of every table's ids in the reply segment, or None where they do not fit (or
        a table is unknown: the pull names it in its error)."""
        if not requests.keys() <= self.shard.tables.keys():
            return None
        return reply.place(
            {
                name: ((ids.shape[0], self.shard.tables[name].dim), np.dtype(np.float32))
                for name, ids in requests.items()
            }
        )

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Run `method`, one of ParameterShard's `MAINTENANCE_METHODS` (stats, evict, snapshots,
        learning rate; the function itself, as ``ParameterShard.stats``), on this shard; with shard
        failover the call is logged by its name for replay."""
        name = maintenance_name(method)
        if self.logged is not None:
            return self.logged.call(name, *args)
        return method(self.shard, *args)

    def write_checkpoint(self, pending: PendingCheckpoint, kind: str) -> FileRecord:
        """Write this shard's file of a pending checkpoint (shards write in parallel)."""
        return write_shard_checkpoint(self.shard, pending, kind)

    def restore(self, chain: list[CheckpointRef], step: int, bucket_map: np.ndarray | None = None) -> None:
        """Load `chain`; with `bucket_map`, also a chain written with another shard count."""
        if self.logged is not None:
            self.logged.restore(chain, step, bucket_map)
        else:
            restore_shard(self.shard, chain, step, bucket_map=bucket_map)

    def checkpointed(self, chain: list[CheckpointRef]) -> None:
        """`chain` is committed and holds this shard's state: its log starts again from it."""
        if self.logged is not None:
            self.logged.checkpointed(chain)

    # -- bucket moves (`psrec.ps.bucket_move`), between steps ----------------------------------
    # A logged shard logs the rows it imports and the buckets it drops (a rebuilt shard replays them);
    # a call may then be sent again after a failure: `move` names an import, a drop finds nothing twice.
    def export_buckets(self, buckets: list[int], num_buckets: int) -> dict[str, np.ndarray]:
        """The rows of `buckets` (with optimizer state, counts, snapshots) for another shard."""
        return bucket_move.bucket_rows(self.shard, buckets, num_buckets)

    def import_buckets(self, arrays: dict[str, np.ndarray], num_buckets: int, move: str) -> int:
        """Add rows another shard exported; returns how many (a repeated `move` adds nothing)."""
        if self.logged is not None:
            return self.logged.import_buckets(arrays, num_buckets=num_buckets, move=move)
        return bucket_move.add_bucket_rows(self.shard, arrays, num_buckets=num_buckets)

    def drop_buckets(self, buckets: list[int], num_buckets: int) -> int:
        """Remove the rows of `buckets` (they moved to another shard); returns how many."""
        if self.logged is not None:
            return self.logged.drop_buckets(buckets, num_buckets=num_buckets)
        return bucket_move.drop_buckets(self.shard, buckets, num_buckets)

    def start_at(self, step: int) -> None:
        """A shard added while training: it expects the pushes of `step` next."""
        if self.logged is not None:
            self.logged.start_at(step)
        else:
            bucket_move.start_at(self.shard, step)

    def failover_report(self) -> dict[str, Any] | None:
        """This process's log: records and bytes written, restores, and how it rebuilt the shard."""
        return self.logged.report() if self.logged is not None else None


# Times a connection sends a call again to a shard that Ray is restarting, before it gives up.
RESEND_ATTEMPTS = 16


# A pull's rows are expected to take at most this many times the bytes of its ids (dim 64 in float32
# is 32x) until a reply says more; a reply too large for its space comes back through Ray.
_FIRST_REPLY_RATIO = 40.0


class _RayPending:
    """One call to a shard actor: what to send again if the shard dies before it answers.

    A call that carries shared-memory arrays (`psrec.ps.shared_arrays`) keeps its `messages` (the
    segments it uses, released once it is answered) and `plain_args`, the same call with the arrays
    themselves, sent instead when the shard cannot open the segments."""

    def __init__(
        self,
        connection: RayConnection,
        send: Callable[[Any, tuple[Any, ...]], Any],
        args: tuple[Any, ...],
        *,
        plain_args: tuple[Any, ...] | None = None,
        messages: tuple[Message, ...] = (),
        tables: list[str] | None = None,
    ) -> None:
        self.connection = connection
        self.send = send  # (actor, args) -> the call's ref: `_send_pull` or `_send_push`
        self.args = args
        self.plain_args = plain_args
        self.messages = messages
        self.tables = tables  # a shared pull's tables, in the order of its reply's keys
        self.answered = False
        self.answer: Any = None  # a shared reply, once read
        self.ref = send(connection.actor, args)

    def resend(self) -> None:
        self.ref = self.send(self.connection.actor, self.args)

    def resend_plain(self) -> None:
        """Send the call again with its arrays themselves (the shard could not open the segments)."""
        assert self.plain_args is not None
        self.release()
        self.args, self.plain_args, self.tables = self.plain_args, None, None
        self.resend()

    def release(self) -> None:
        for message in self.messages:
            self.connection.pool.release(message)  # type: ignore[union-attr]
        self.messages = ()

    def result(self) -> Any:
        return self.connection.result_of(self)


def _send_pull(actor: Any, args: tuple[Any, ...]) -> Any:
    """`ShardActor.pull` on the actor; its ref."""
    return actor.pull.remote(*args)


def _send_push(actor: Any, args: tuple[Any, ...]) -> Any:
    """`ShardActor.push` on the actor; its ref."""
    return actor.push.remote(*args)


class RayConnection:
    """The client's view of a `ShardActor` handle.

    Calls not yet answered are kept in submission order. When one fails because the shard is being
    restarted (`ActorUnavailableError`), every kept call whose first copy failed is sent again in
    that order (Ray does not keep the order of calls it retries itself), and the waiting call
    returns once the restarted shard answers it. A shard that died for good (`ActorDiedError`)
    raises as before: the driver then rolls the job back.

    With `shared_memory` (the default), a shard on this machine gets the bulk of pulls and pushes
    through shared-memory segments this connection owns (`psrec.ps.shared_arrays`): the pushed ids
    and float32 gradients, the pulled ids and the rows coming back. A shard that cannot open them
    (on another machine) fails those calls before it changes anything; they are sent again, in
    order, with the arrays themselves, and so is everything after.
    """

    def __init__(self, actor: Any, *, caller: str | None = None, shared_memory: bool = True) -> None:
        self.actor = actor
        # Names this connection's training pulls (`LoggedShard.pull`): numbered by the caller when it
        # gives `request` (a trainer: its step + 1, the same for its replacement), else counted here.
        self.caller = caller
        self._anonymous = uuid.uuid4().hex
        self._pulls = 0
        self._outstanding: list[_RayPending] = []
        self.resent = 0
        self.pool: SegmentPool | None = SegmentPool(_segment_prefix()) if shared_memory else None
        self._same_machine: bool | None = None  # asked of the shard at the first call
        self._reply_ratio = _FIRST_REPLY_RATIO

    def close(self) -> None:
        """Unlink this connection's shared-memory segments (also done when it is garbage-collected)."""
        if self.pool is not None:
            self.pool.close()

    def pull(self, requests: dict[str, np.ndarray], *, train: bool, request: int | None = None) -> Pending:
        if not train:
            args: tuple[Any, ...] = (requests, train)
        elif request is not None and self.caller is not None:
            args = (requests, train, self.caller, request)
        else:
            self._pulls += 1
            args = (requests, train, self._anonymous, self._pulls)
        if requests and self._sharing():
            assert self.pool is not None
            tables = list(requests)
            ids_bytes = sum(ids.nbytes for ids in requests.values())
            sent = self.pool.write({str(i): requests[name] for i, name in enumerate(tables)})
            reply = self.pool.reserve(int(ids_bytes * self._reply_ratio) + 4096)
            if sent is not None and reply is not None:
                assert sent.arrays is not None and reply.reply is not None
                shared = SharedRequest(tables, sent.arrays, reply.reply)
                return self._submit(
                    _send_pull, (shared, *args[1:]), plain_args=args, messages=(sent, reply), tables=tables
                )
            for message in (sent, reply):
                if message is not None:
                    self.pool.release(message)
        return self._submit(_send_pull, args)

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending:
        args = (trainer, request_id, step, gradients)
        plain = all(isinstance(grads, np.ndarray) for _, grads in gradients.values())
        if gradients and plain and self._sharing():
            assert self.pool is not None
            tables = list(gradients)
            arrays: dict[str, np.ndarray] = {}
            for i, name in enumerate(tables):
                ids, grads = gradients[name]
                arrays[f"{i}/ids"], arrays[f"{i}/grads"] = ids, np.asarray(grads)
            sent = self.pool.write(arrays)
            if sent is not None:
                assert sent.arrays is not None
                shared = SharedGradients(tables, sent.arrays)
                return self._submit(
                    _send_push, (trainer, request_id, step, shared), plain_args=args, messages=(sent,)
                )
        return self._submit(_send_push, args)

    def prefetch(self, requests: dict[str, np.ndarray]) -> int:
        """Tell the shard a coming training pull's ids (`ShardActor.prefetch`), not waiting for it:
        the shard runs it before the caller's later calls, and a prefetch lost with a dying shard
        changes nothing, so it is not kept for sending again. Returns 0 (the count is not waited for)."""
        self.actor.prefetch.remote(requests)
        return 0

    def _sharing(self) -> bool:
        """Whether calls go through shared memory: the shard runs on this machine."""
        if self.pool is None:
            return False
        if self._same_machine is None:
            import ray

            try:
                where = ray.get(self.actor.location.remote(), timeout=RESTART_WAIT_S)
                self._same_machine = where["node_id"] == ray.get_runtime_context().get_node_id()
            except Exception:  # noqa: BLE001 - its own calls raise what is wrong with the shard
                return False
        return self._same_machine

    def _submit(
        self, send: Callable[[Any, tuple[Any, ...]], Any], args: tuple[Any, ...], **shared: Any
    ) -> _RayPending:
        pending = _RayPending(self, send, args, **shared)
        self._outstanding.append(pending)
        return pending

    def result_of(self, pending: _RayPending) -> Any:
        import ray
        from ray.exceptions import RayActorError

        for attempt in range(RESEND_ATTEMPTS + 1):
            try:
                value = ray.get(pending.ref)
            except RayActorError as error:
                if attempt == RESEND_ATTEMPTS or not restarting(self.actor, error):
                    raise
                self._resend_failed()
                continue
            except SharedMemoryUnavailable:
                self._resend_plain()
                continue
            if pending in self._outstanding:
                self._outstanding.remove(pending)
            return self._answer(pending, value)
        raise AssertionError("unreachable")

    def _answer(self, pending: _RayPending, value: Any) -> Any:
        """The call's answer: a shared-memory reply read in place (kept with the call, so asking
        again gets the same arrays and they hold the segment); the call's segments released."""
        if pending.answered:
            return pending.answer
        messages = pending.messages
        pending.release()
        if isinstance(value, SharedArrays):
            assert self.pool is not None and pending.tables is not None
            arrays = self.pool.read(messages[-1], value)
            value = {name: arrays[name] for name in pending.tables if name in arrays}
            pending.answered, pending.answer = True, value
            return value
        if pending.tables is not None and isinstance(value, dict):  # the rows did not fit: learn their size
            ids_bytes = sum(array.nbytes for array in pending.plain_args[0].values())  # type: ignore[index]
            rows_bytes = sum(array.nbytes for array in value.values())
            self._reply_ratio = max(self._reply_ratio, rows_bytes / max(ids_bytes, 1) * 1.1)
        return value

    def _resend_plain(self) -> None:
        """The shard cannot open this connection's segments: send every kept call that used them and
        failed again with its arrays, in submission order, and stop using shared memory."""
        import ray

        if self._same_machine:
            logger.warning("shard cannot open this trainer's shared memory: sending arrays through Ray")
        self._same_machine = False
        for pending in self._outstanding:
            if pending.plain_args is None:
                continue
            try:
                ray.get(pending.ref)
            except SharedMemoryUnavailable:
                pending.resend_plain()
            except Exception:  # noqa: BLE001 - its own error is raised when its result is asked for
                continue

    def _resend_failed(self) -> None:
        """Wait until every kept call has an answer or has failed, then send the failed ones again, in
        their submission order (a restarted shard executes one caller's calls in that order)."""
        import ray
        from ray.exceptions import RayActorError

        failed = []
        for pending in self._outstanding:
            try:
                ray.get(pending.ref)
            except RayActorError:
                failed.append(pending)
            except Exception:  # noqa: BLE001 - its own error is raised when its result is asked for
                continue
        if failed:
            logger.warning("shard unavailable: sending %d calls again once it is back", len(failed))
        for pending in failed:
            pending.resend()
            self.resent += 1


def _segment_prefix() -> str:
    """This connection's segment names: the Ray job's prefix (`job_prefix`) and a unique part."""
    import ray

    job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else "nojob"
    return job_prefix(job) + uuid.uuid4().hex[:12]


# How long a caller waits for a shard that Ray is restarting to answer again.
RESTART_WAIT_S = 600.0


def restarting(actor: Any, error: BaseException) -> bool:
    """Whether a call failed because `actor` is being restarted (or already was), not dead for good.

    `ActorUnavailableError` says so; an `ActorDiedError` may also reach calls in flight while Ray
    restarts the actor, so the actor is asked for its pid: it answers once it is back, and a call to
    an actor dead for good fails at once.
    """
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    if isinstance(error, ActorUnavailableError):
        return True
    try:
        ray.get(actor.pid.remote(), timeout=RESTART_WAIT_S)
    except (RayActorError, GetTimeoutError):
        return False
    return True


def actor_location() -> dict[str, Any]:
    """The Ray node the calling actor runs on and its process id (for the placement report)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }
