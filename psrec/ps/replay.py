"""A shard that logs every operation that changes it, and rebuilds itself from checkpoint + log.

`LoggedShard` wraps a `ParameterShard` with its `PushLog` (`psrec.ps.push_log`). Each training
pull, push and table-changing maintenance call is appended to the log *before* it runs; at every
committed checkpoint the log starts a new segment on that checkpoint. When the shard's process dies,
its replacement (`LoggedShard.open` on the same directory) restores only this shard's file of the
segment's checkpoint chain, then re-runs the segment's operations in their logged order: the
tables, optimizer state, admission counters, clocks, request ids and snapshots are then exactly what
they were when the last operation was logged. Nothing else is restored or recomputed.

Retries are idempotent: a push whose request id is not newer than the trainer's last is dropped by
the shard (and not logged), and a training pull carries a per-caller sequence number, so a pull
sent again after a failure (its first copy ran, its reply was lost) is answered without inserting or
counting anything a second time: with the rows of its first reply when it is one of the caller's
last `REPLIES_KEPT` pulls (the shard may have applied a step's update since: a trainer that repeats
the step it died in must see the rows that step saw; `psrec.elastic.trainer_failover`), else with the
current rows. The replies kept are rebuilt by the replay.

    prepare_fresh(Path("log/shard-0"))                                          # the driver, once
    shard = LoggedShard.open(ParameterShard(0, tables), Path("log/shard-0"))   # fresh or recovered
    shard.pull({"t": ids}, train=True, caller="trainer-0", request=1)
    shard.push(0, 0, 0, {"t": (ids, grads)})
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from psrec.checkpoint import CheckpointRef
from psrec.checkpoint.files import read_arrays, write_arrays
from psrec.ps import bucket_move
from psrec.ps.push_log import LogRecord, PushLog, PushLogError, Segment, latest_segment, segment_paths
from psrec.ps.shard import ParameterShard, TableGradients
from psrec.ps.shard_checkpoint import restore_shard
from psrec.ps.wire import ScaledFp16, decode_gradients
from psrec.storage import location

logger = logging.getLogger(__name__)

RECOVERING_FILE = "recovering.json"
FRESH_FILE = "fresh"
RECOVERIES_FILE = "recoveries.jsonl"  # one line per rebuild of the shard: its recovery report
# Training pulls per caller whose replies a shard keeps: the step a trainer died in and the next one
# it may have pulled ahead, with one to spare.
REPLIES_KEPT = 3


def recoveries(directory: Path) -> list[dict[str, Any]]:
    """Every rebuild of the shard whose log is `directory`, oldest first (`LoggedShard.recovery`)."""
    path = directory / RECOVERIES_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# ParameterShard maintenance calls that change the tables (logged); the others only read.
LOGGED_CALLS = frozenset(
    {
        "set_learning_rate",
        "set_num_trainers",
        "evict",
        "save_snapshot",
        "restore_snapshot",
        "confirm_checkpoint",
    }
)


def prepare_fresh(directory: Path) -> None:
    """Mark `directory` as the log of a shard about to be created with fresh tables (the driver does
    this; a process that finds neither this mark nor a log refuses to start with fresh tables)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / FRESH_FILE).touch()


def announce_recovery(directory: Path) -> bool:
    """When `directory` holds a log, write ``recovering.json`` (this process's id and start time):
    the process that is rebuilding the shard. Returns whether there is a log to recover from."""
    if not segment_paths(directory):
        return False
    temporary = directory / f".recovering-{os.getpid()}.json"
    temporary.write_text(json.dumps({"pid": os.getpid(), "started": time.time()}))
    temporary.replace(directory / RECOVERING_FILE)
    return True


def ref_to_json(ref: CheckpointRef) -> dict[str, Any]:
    return {
        "path": str(ref.path),
        "step": ref.step,
        "kind": ref.kind,
        "checkpoint_id": ref.checkpoint_id,
        "parent_id": ref.parent_id,
        "base_id": ref.base_id,
        "created": ref.created,
    }


def ref_from_json(value: dict[str, Any]) -> CheckpointRef:
    return CheckpointRef(
        path=location(value["path"]),
        step=int(value["step"]),
        kind=value["kind"],
        checkpoint_id=value["checkpoint_id"],
        parent_id=value["parent_id"],
        base_id=value["base_id"],
        created=float(value["created"]),
    )


class LoggedShard:
    """A `ParameterShard` behind its write-ahead log (see the module docstring)."""

    def __init__(self, shard: ParameterShard, log: PushLog) -> None:
        self.shard = shard
        self.log = log
        self.last_pull: dict[str, int] = {}  # caller -> sequence number of its last training pull
        # caller -> its last REPLIES_KEPT training pulls: (number, tables, ids, rows returned)
        self._replies: dict[str, collections.deque[_Reply]] = {}
        self.restores = 0  # restores the driver asked for (a rollback or a resume)
        self.recovery: dict[str, Any] | None = None  # how this process rebuilt the shard, if it did
        self._restored = 0.0  # when the checkpoint chain was loaded, during a recovery
        self._snapshot_files: set[str] = set()  # snapshot tags whose file holds the current snapshot
        self.bucket_map: list[int] | None = None  # the layout given at the last restore (None: as written)
        self._imports: dict[str, int] = {}  # bucket moves imported since the segment's base: rows added

    # -- opening: fresh or recovered --------------------------------------------------------------
    @classmethod
    def open(
        cls, shard: ParameterShard, directory: Path, *, fsync: bool = False, started: float | None = None
    ) -> LoggedShard:
        """A fresh shard on a directory `prepare_fresh` marked; otherwise the shard rebuilt from the
        newest segment (`started`: when the rebuilding process began, for its recovery report)."""
        logged = cls(shard, PushLog(directory, fsync=fsync))
        if not segment_paths(directory):
            if not (directory / FRESH_FILE).exists():
                raise PushLogError(
                    f"shard {shard.shard_index}: {directory} holds neither a log nor the mark of a new "
                    "shard: this process cannot see the log of the shard it replaces. Set "
                    "fault_tolerance.push_log to a directory every node of the cluster reaches"
                )
            logged.log.start_segment({"kind": "fresh"})
            (directory / FRESH_FILE).unlink()
            return logged
        started = time.time() if started is None else started
        segment, skipped = latest_segment(directory)
        if segment is None:
            raise PushLogError(f"{directory}: no readable segment to recover from: {'; '.join(skipped)}")
        for reason in skipped:
            logger.warning("shard %d: passed over %s", shard.shard_index, reason)
        logged._recover(segment)
        logged.log.continue_segment(segment)
        logged.recovery = {
            "pid": os.getpid(),
            "started": started,
            "restored": logged._restored,
            "ready": time.time(),
            "segment": segment.path.name,
            "base": segment.base.meta.get("kind"),
            "base_step": segment.base.meta.get("step"),
            "operations_replayed": len(segment.records),
            "pushes_replayed": sum(1 for r in segment.records if r.op == "push"),
            "log_bytes": segment.valid_bytes,
            "torn_record_dropped": segment.torn is not None,
        }
        with open(directory / RECOVERIES_FILE, "a", encoding="utf-8") as history:
            history.write(json.dumps(logged.recovery) + "\n")
        logger.warning("shard %d rebuilt from its log: %s", shard.shard_index, logged.recovery)
        return logged

    def _recover(self, segment: Segment) -> None:
        base = segment.base.meta
        if base["kind"] == "checkpoint":
            chain = [ref_from_json(ref) for ref in base["chain"]]
            layout = base.get("bucket_map")
            self.bucket_map = layout
            if "num_trainers" in base:  # set first: the restore's request ids cover every trainer
                self.shard.set_num_trainers(int(base["num_trainers"]))
            restore_shard(
                self.shard, chain, int(base["step"]), bucket_map=None if layout is None else np.array(layout)
            )
            for name, lr in base["learning_rates"].items():
                self.shard.set_learning_rate(float(lr), [name])
            self.last_pull = {caller: int(n) for caller, n in base["last_pull"].items()}
            for tag in base["snapshots"]:
                self.shard.load_snapshot_arrays(tag, read_arrays(self._snapshot_path(tag)))
                self._snapshot_files.add(tag)
            if base.get("needs_full_checkpoint"):
                self.shard.needs_full_checkpoint = True

        elif base["kind"] != "fresh":
            raise PushLogError(f"{segment.path}: unknown base {base['kind']!r}")
        self._restored = time.time()
        for record in segment.records:
            self._apply(record)

    def _apply(self, record: LogRecord) -> Any:
        """Run one logged operation on the shard (replay, and live after logging it)."""
        meta = record.meta
        if record.op == "pull":
            requests = {name: record.arrays[f"{i}/ids"] for i, name in enumerate(meta["tables"])}
            rows = self.shard.pull(requests, train=True)
            if meta["caller"] is not None:
                self.last_pull[meta["caller"]] = int(meta["request"])
                kept = self._replies.setdefault(meta["caller"], collections.deque(maxlen=REPLIES_KEPT))
                kept.append(_Reply(int(meta["request"]), requests, rows))
            return rows
        if record.op == "push":
            return self.shard.push(
                int(meta["trainer"]), int(meta["request"]), int(meta["step"]), _gradients(record)
            )
        if record.op == "import":
            added = bucket_move.add_bucket_rows(
                self.shard, dict(record.arrays), num_buckets=int(meta["num_buckets"])
            )
            self._imports[meta["move"]] = added
            self.bucket_map = None  # the shard's rows no longer follow the layout it was restored into
            return added
        if record.op == "drop":
            self.bucket_map = None
            return bucket_move.drop_buckets(self.shard, meta["buckets"], int(meta["num_buckets"]))
        if record.op == "start_at":
            return bucket_move.start_at(self.shard, int(meta["step"]))
        if record.op == "call":
            if meta["method"] == "save_snapshot":
                self._snapshot_files.discard(meta["args"][0])
            return getattr(self.shard, meta["method"])(*meta["args"])
        raise PushLogError(f"{self.log.directory}: unknown operation {record.op!r}")

    # -- live operations ------------------------------------------------------------------------
    def pull(
        self,
        requests: dict[str, np.ndarray],
        *,
        train: bool,
        caller: str | None = None,
        request: int | None = None,
    ) -> dict[str, np.ndarray]:
        if not train:
            return self.shard.pull(requests, train=False)
        if caller is not None and request is not None and request <= self.last_pull.get(caller, 0):
            # Sent again after a failure: its first copy ran (and is logged); answer without a change,
            # with the first reply's rows while it is kept.
            for reply in self._replies.get(caller, ()):
                if reply.request == request and reply.asks(requests):
                    return reply.rows
            return self.shard.pull(requests, train=False)
        names = list(requests)
        arrays = {f"{i}/ids": requests[name] for i, name in enumerate(names)}
        record = LogRecord("pull", {"caller": caller, "request": request, "tables": names}, arrays)
        return self._logged(record)

    def push(self, trainer: int, request_id: int, step: int, gradients: dict[str, Any]) -> bool:
        """`gradients`: table -> (ids, gradients as on the wire: float32 rows or `ScaledFp16`)."""
        if request_id <= self.shard.last_request.get(trainer, -1):
            return self.shard.push(trainer, request_id, step, {})  # a retry: dropped and counted
        names, arrays = [], {}
        for i, (name, (ids, grads)) in enumerate(gradients.items()):
            names.append(name)
            arrays[f"{i}/ids"] = ids
            if isinstance(grads, ScaledFp16):
                arrays[f"{i}/values"], arrays[f"{i}/scales"] = grads.values, grads.scales
            else:
                arrays[f"{i}/grads"] = grads
        meta = {"trainer": trainer, "request": request_id, "step": step, "tables": names}
        return bool(self._logged(LogRecord("push", meta, arrays)))

    def call(self, method: str, *args: Any) -> Any:
        if method not in LOGGED_CALLS:
            return getattr(self.shard, method)(*args)
        return self._logged(LogRecord("call", {"method": method, "args": list(args)}))

    # -- bucket moves (`psrec.ps.bucket_move`): logged, so that a rebuilt shard has them too ----------
    def import_buckets(self, arrays: dict[str, np.ndarray], *, num_buckets: int, move: str) -> int:
        """Add the rows another shard exported (`bucket_move.add_bucket_rows`); `move` names the
        move, so that an import sent again after a failure (it ran, its reply was lost) adds nothing."""
        if move in self._imports:
            return self._imports[move]
        record = LogRecord("import", {"move": move, "num_buckets": num_buckets}, dict(arrays))
        return int(self._logged(record))

    def drop_buckets(self, buckets: list[int], *, num_buckets: int) -> int:
        """Remove the rows of `buckets` (idempotent: a repeat finds none)."""
        meta = {"buckets": [int(bucket) for bucket in buckets], "num_buckets": num_buckets}
        return int(self._logged(LogRecord("drop", meta)))

    def start_at(self, step: int) -> None:
        """A shard added while training expects the pushes of `step` next."""
        self._logged(LogRecord("start_at", {"step": int(step)}))

    def _logged(self, record: LogRecord) -> Any:
        size = self.log.append(record.op, record.meta, record.arrays)
        try:
            return self._apply(record)
        except BaseException:
            self.log.retract(size)  # it raised before changing anything it validates (or the run fails)
            raise

    # -- checkpoints: a new segment ---------------------------------------------------------------
    def checkpointed(self, chain: list[CheckpointRef]) -> None:
        """`chain` is committed and holds this shard's current state: start a new segment on it.

        In-memory snapshots are written next to the log first (a replay from this base cannot
        recreate them)."""
        tags = self.shard.snapshot_tags()
        for tag in tags:
            if tag not in self._snapshot_files:  # taken since its file was written (or never written)
                write_arrays(self._snapshot_path(tag), self.shard.snapshot_arrays(tag))
                self._snapshot_files.add(tag)
        base = {
            "kind": "checkpoint",
            "chain": [ref_to_json(ref) for ref in chain],
            "step": chain[-1].step,
            "learning_rates": {name: table.optimizer.lr for name, table in self.shard.tables.items()},
            "last_pull": dict(self.last_pull),
            "snapshots": tags,
            "needs_full_checkpoint": self.shard.needs_full_checkpoint,
            "bucket_map": self.bucket_map,
            # a restarted process is built with the trainer count the shard started with
            "num_trainers": self.shard.num_trainers,
        }
        self.log.start_segment(base)
        self._imports.clear()  # a move finishes before the checkpoint that follows it

    def restore(self, chain: list[CheckpointRef], step: int, bucket_map: np.ndarray | None = None) -> None:
        """The driver's restore (a rollback or a resume): load the chain, then log on top of it.
        `bucket_map`: this shard's layout, for a chain written with another (`restore_shard`)."""
        restore_shard(self.shard, chain, step, bucket_map=bucket_map)
        if bucket_map is not None:
            self.bucket_map = [int(shard) for shard in bucket_map]
        # The steps after `step` run again: their pulls (numbered step + 1 on) are new ones.
        self.last_pull = {caller: min(number, step) for caller, number in self.last_pull.items()}
        self._replies.clear()
        self.restores += 1
        self.checkpointed(chain)

    def _snapshot_path(self, tag: str) -> Path:
        return self.log.directory / f"snapshot-{tag}.npz"

    def report(self) -> dict[str, Any]:
        """What the log did in this process: records and bytes written, restores, its recovery."""
        return {
            "pid": os.getpid(),
            "records_written": self.log.records_written,
            "bytes_written": self.log.bytes_written,
            "seconds_writing": self.log.seconds_writing,
            "segment": self.log.segment_number,
            "restores": self.restores,
            "recovery": self.recovery,
        }


@dataclass(frozen=True)
class _Reply:
    """One training pull a shard answered: its number, what it asked and the rows it got."""

    request: int
    requests: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]

    def asks(self, requests: dict[str, np.ndarray]) -> bool:
        """Whether `requests` asks for the same ids of the same tables."""
        return requests.keys() == self.requests.keys() and all(
            np.array_equal(ids, self.requests[name]) for name, ids in requests.items()
        )


def _gradients(record: LogRecord) -> TableGradients:
    out: TableGradients = {}
    for i, name in enumerate(record.meta["tables"]):
        if f"{i}/grads" in record.arrays:
            grads = record.arrays[f"{i}/grads"]
        else:
            grads = decode_gradients(ScaledFp16(record.arrays[f"{i}/values"], record.arrays[f"{i}/scales"]))
        out[name] = (record.arrays[f"{i}/ids"], grads)
    return out
