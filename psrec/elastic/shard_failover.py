"""Shard failover on Ray: one dead shard is rebuilt alone, the job goes on without a rollback.

With ``fault_tolerance.shard_failover`` the Ray runtime creates its shard actors with Ray's
``max_restarts`` and gives each one a directory for its log (`ShardFailover.shard_options`). Then:

1. every shard logs each operation that changes it before it runs (`psrec.ps.replay`), and starts
   its log again from every committed checkpoint (`ShardFailover.committed`);
2. when a shard's process dies, Ray starts it again with the same arguments; the new process finds
   the log, loads only its own file of the log's checkpoint chain and replays the log, before it
   answers any call;
3. the trainers' calls that the dead process did not answer fail (`ActorUnavailableError`, or
   `ActorDiedError` until Ray has it back); each trainer's connection sends them again, in order
   (`psrec.ps.actors.RayConnection`), and waits: request ids make the repeats idempotent. The driver's own calls to the shards (checkpoint
   files, stats, learning rates) are sent again the same way (`psrec.cluster.groups.answered_refs`).

The other shards and the trainers keep their state; no step is recomputed. When a shard cannot come
back (its restarts are used up, its log is unreadable), its calls raise `ActorDiedError` and the
driver rolls the whole job back to the last checkpoint as before (`psrec.checkpoint.policy.choose_restart`).

Where the log lives: ``fault_tolerance.push_log``, a directory every shard's node can read (local
disk on one machine, a shared file system on a cluster); by default the temporary directory's
``psrec-push-log``, which serves one machine only (a shard restarted on another node that cannot see
its log refuses to start, and the job rolls back). Each runtime uses its own subdirectory and
removes it at shutdown.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from psrec import checkpoint, storage
from psrec.checkpoint import CheckpointRef
from psrec.checkpoint.policy import checkpoint_chain
from psrec.cluster.groups import RemoteCall, answered
from psrec.config import ConfigError, RunConfig
from psrec.ps.actors import ShardActor
from psrec.ps.replay import RECOVERIES_FILE, prepare_fresh, recoveries

logger = logging.getLogger(__name__)

DEFAULT_LOG_DIR = "psrec-push-log"  # under the temporary directory when push_log is not set


class ShardFailover:
    """The runtime's side of shard failover for one Ray runtime (see the module docstring)."""

    def __init__(self, root: Path, *, run_dir: str, max_restarts: int, fsync: bool) -> None:
        self.root = root
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_run(cls, config: RunConfig) -> ShardFailover | None:
        """The failover of this run, or None when it is off (or has no shards to fail over)."""
        settings = config.fault_tolerance
        if not settings.shard_failover or config.ps.strategy == "collective":
            return None
        if not config.checkpoint.enabled:  # a log starts again only at a checkpoint: it would only grow
            logger.info("shard failover is off: checkpoint.enabled is false")
            return None
        if settings.push_log is None:
            parent = Path(tempfile.gettempdir()) / DEFAULT_LOG_DIR
        elif storage.is_uri(settings.push_log):
            raise ConfigError(
                f"fault_tolerance.push_log: {settings.push_log!r} is a store URI, where a log cannot be "
                "appended to: give a directory (a shared file system on a cluster)"
            )
        else:
            parent = Path(settings.push_log)
        return cls(
            parent / uuid.uuid4().hex[:12],
            run_dir=str(config.run_dir),
            max_restarts=settings.max_restarts,
            fsync=settings.push_log_fsync,
        )

    def actor_class(self, actor: type) -> Any:
        """`actor` as a Ray actor class that Ray restarts in place up to `max_restarts` times."""
        import ray

        return ray.remote(max_restarts=self.max_restarts)(actor)

    def shard_directory(self, index: int) -> Path:
        return self.root / f"shard-{index}"

    def shard_options(self, index: int) -> dict[str, Any]:
        """The `ShardActor` keyword arguments of shard `index`, about to be created with fresh tables
        (a log left by an earlier shard of that index, one a resharding removed, is dropped)."""
        self.forget(index)
        prepare_fresh(self.shard_directory(index))
        return {"push_log": str(self.shard_directory(index)), "push_log_fsync": self.fsync}

    def forget(self, index: int) -> None:
        """Drop shard `index`'s log before the runtime replaces it and restores it from a checkpoint
        (its history of rebuilds stays)."""
        directory = self.shard_directory(index)
        if directory.is_dir():
            for path in directory.iterdir():
                if path.name != RECOVERIES_FILE:
                    path.unlink(missing_ok=True)

    def failovers(self) -> list[dict[str, Any]]:
        """Every shard rebuilt alone so far (a resharding may have removed it since), oldest first:
        its index and recovery report."""
        found = [
            {"shard": int(directory.name.removeprefix("shard-")), **report}
            for directory in self.root.glob("shard-*")
            for report in recoveries(directory)
        ]
        return sorted(found, key=lambda report: report["started"])

    def committed(self, shards: list[Any], ref: CheckpointRef) -> None:
        """`ref` is committed and every shard's state is in it: their logs start again from it."""
        chain = checkpoint_chain(ref, checkpoint.list_checkpoints(self.run_dir))
        if isinstance(chain, str):
            raise checkpoint.CheckpointError(f"{ref.name} was just committed, but {chain}")
        answered([RemoteCall(shard, ShardActor.checkpointed, (chain,)) for shard in shards])

    def reports(self, shards: list[Any]) -> list[dict[str, Any] | None]:
        """Each shard process's log report (`LoggedShard.report`)."""
        return answered([RemoteCall(shard, ShardActor.failover_report) for shard in shards])

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
