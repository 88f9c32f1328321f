"""The driver's checkpoints and restarts: when a checkpoint is due (``checkpoint.every_steps`` /
``every_seconds``), whether it is full or a delta, writing it through the runtime with its time and
size, retention, the chain a run restores from; and whether a failure is recovered by rolling back
to that chain (`restart_decision`, over the pure rule `psrec.checkpoint.policy.choose_restart`).

The training loop (`psrec.train.loop.Driver`) owns one `CheckpointSchedule` and says when to write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from psrec import checkpoint, storage
from psrec.checkpoint import CheckpointRef
from psrec.checkpoint.files import discard_directory
from psrec.checkpoint.format import MANIFEST_FILE
from psrec.checkpoint.policy import RestartDecision, choose_restart
from psrec.config import ConfigError, RunConfig, normalized_fingerprint
from psrec.train.runtime_base import Runtime

logger = logging.getLogger(__name__)


class CheckpointSchedule:
    """The checkpoints of one run: the last one written or restored, when it was written, how many
    deltas followed the last full one, and the time and size of each written."""

    def __init__(self, config: RunConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.run_dir = str(config.run_dir)
        self.last: CheckpointRef | None = None
        self.last_at = time.monotonic()
        self.since_full = 0
        self.seconds: list[dict[str, Any]] = []  # {"step", "kind", "seconds", "bytes"} of each written

    def next_full(self) -> None:
        """Make the next checkpoint full (rows moved between shards are in no delta)."""
        self.since_full = self.config.checkpoint.full_every

    def due(self, step: int) -> bool:
        """A checkpoint is due: steps were trained since the last one, and the step is a multiple of
        `checkpoint.every_steps` or `every_seconds` passed since the last one."""
        settings = self.config.checkpoint
        if self.last is not None and self.last.step == step:
            return False  # nothing new (a quiet stream's chunk)
        if settings.every_steps is not None and step % settings.every_steps == 0:
            return True
        return (
            settings.every_seconds is not None and time.monotonic() - self.last_at >= settings.every_seconds
        )

    def write(self, step: int, extra: Callable[[], dict[str, Any]], *, pinned_step: int | None) -> None:
        """Write the checkpoint of `step` (when ``checkpoint.enabled``) with the driver's `extra()`,
        then apply retention, keeping the chain of `pinned_step` (the best model's)."""
        settings = self.config.checkpoint
        if not settings.enabled:
            return
        last = self.last
        # Same step as the last checkpoint, new driver state (an epoch's end, the max_steps stop, a
        # resume with nothing left to train): written full. The shards' deltas start at their last
        # committed or restored checkpoint, so a delta taken now would hold almost no rows, not those
        # of the delta it replaces. It replaces that checkpoint (deleted once the new one is committed).
        if last is None or last.step == step or self.since_full + 1 >= settings.full_every:
            kind, parent = "full", None
        else:
            kind, parent = "delta", last
        start = time.perf_counter()
        self.last_at = time.monotonic()
        ref = self.runtime.save_checkpoint(self.run_dir, kind=kind, parent=parent, extra=extra())
        manifest = checkpoint.read_manifest(ref)
        self.seconds.append(
            {
                "step": ref.step,
                "kind": kind,
                "seconds": time.perf_counter() - start,
                "bytes": sum(f["size"] for f in manifest["files"].values()),
            }
        )
        if last is not None and last.step == ref.step and last.kind != ref.kind:
            # the delta of this step (one of the same kind and name the commit replaced itself)
            discard_directory(last.path, commit_marker=MANIFEST_FILE)
        self.last = ref
        self.since_full = 0 if kind == "full" else self.since_full + 1
        checkpoint.apply_retention(
            self.run_dir, keep_last=settings.keep_last, verify_checksums=False, pinned_step=pinned_step
        )

    def chain(self, *, at_step: int | None = None) -> list[CheckpointRef]:
        """The newest valid chain of this config's checkpoints (or the one ending at `at_step`)."""
        return checkpoint.resolve_restore_chain(
            self.run_dir,
            config=self.config.fingerprint_dict(),
            normalize=normalized_fingerprint,
            at_step=at_step,
        )

    def restored(self, chain: list[CheckpointRef] | None) -> None:
        """The run was restored to `chain` (None: to nothing, it starts over)."""
        if chain is None:
            self.last, self.since_full = None, 0
            return
        self.last = chain[-1]
        self.since_full = len(chain) - 1


def has_checkpoints(run_dir: storage.Location) -> bool:
    """Whether `run_dir` holds checkpoints (False when it does not exist); a ConfigError when it
    cannot be read."""
    try:
        return bool(checkpoint.list_checkpoints(run_dir)) if run_dir.is_dir() else False
    except (storage.StorageError, checkpoint.CheckpointError) as error:
        raise ConfigError(f"run_dir {str(run_dir)!r} cannot be read: {error}") from None


def restart_decision(
    error: BaseException, runtime: Runtime, *, restarts: int, max_restarts: int
) -> RestartDecision:
    """`choose_restart` over this failure: a Ray error and actors that no longer answer."""
    actor_failure = is_actor_failure(error)
    dead = runtime.dead_actors() if actor_failure else []  # asked only after an actor failure
    if dead:
        logger.warning("dead: %s", ", ".join(dead))
    decision = choose_restart(
        actor_failure=actor_failure,
        dead_actors=dead,
        restarts=restarts,
        max_restarts=max_restarts,
        failovers=len(runtime.failovers()),
    )
    if decision.reason == "max restarts reached":
        logger.error("%s", decision.detail)
    return decision


def is_actor_failure(error: BaseException) -> bool:
    """The Ray-specific half of the restart decision: did the error come from Ray (a task or actor)?"""
    try:
        from ray.exceptions import RayError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, RayError)
