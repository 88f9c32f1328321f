"""Following a training run: each newly committed checkpoint becomes the next served version.

`DeltaFollower.poll` lists the run's committed checkpoints and, when there is one newer than the
served version, builds the next `ModelVersion` aside and swaps it in whole (`ServingModel.swap`):

- a delta whose parent is the served checkpoint: its shard files (checksums verified first) are
  applied to the served tables (`psrec.serve.tables.ServingTable.apply_delta`: removed ids dropped,
  changed rows written whole, into new tables);
- any other newer checkpoint (a full one, or a delta after one this server could not apply): the
  tables are rebuilt from its whole chain, as `psrec export` builds them;
- the dense weights of that checkpoint are loaded into a copy of the served program (the exported
  graph keeps the model's parameter names), so no psrec model code is needed here either.

A checkpoint that fails verification (a file missing, truncated or with the wrong sha256) is not
applied: the previous version keeps serving, the failure is logged once, and the next valid
checkpoint whose chain verifies is taken. The decision which checkpoint to take is the pure
function `next_checkpoint`.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from psrec.checkpoint.format import CheckpointError
from psrec.checkpoint.load import load_checkpoint
from psrec.checkpoint.manifest import scan
from psrec.checkpoint.policy import CheckpointRef
from psrec.serve.export import apply_delta_files, chain_to, load_tables, only_tables, version_of
from psrec.serve.model_dir import ExportError
from psrec.serve.scoring import ModelVersion, ServingModel
from psrec.serve.sharded import ShardedTable, prepare_version
from psrec.storage import StorageError, StoragePath, location

logger = logging.getLogger(__name__)

PROGRAM_PREFIX = "model."  # the exported wrapper's name for the model (`psrec.serve.export.ProgramInput`)


@dataclass(frozen=True)
class FollowStep:
    """What to do next: apply ``ref`` as a delta on the served tables, or rebuild from its chain."""

    ref: CheckpointRef
    as_delta: bool


def next_checkpoint(
    refs: list[CheckpointRef], *, served_id: str, served_step: int, failed: set[str]
) -> FollowStep | None:
    """The newest committed checkpoint after the served one that has not failed (None: nothing new).

    ``refs`` are oldest first. A delta whose parent is the served checkpoint is applied as a delta;
    anything else newer is rebuilt from its chain.
    """
    newer = [ref for ref in refs if ref.step > served_step and ref.checkpoint_id not in failed]
    if not newer:
        return None
    following = [ref for ref in newer if ref.kind == "delta" and ref.parent_id == served_id]
    if following:
        return FollowStep(following[0], as_delta=True)
    return FollowStep(newer[-1], as_delta=False)


def reweighted(program: torch.nn.Module, dense_model_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of an exported program with the dense weights of a checkpoint."""
    fresh = copy.deepcopy(program)
    state = {PROGRAM_PREFIX + name: value for name, value in dense_model_state.items()}
    expected = set(fresh.state_dict())
    if set(state) != expected:
        missing = sorted(expected - set(state))[:3]
        extra = sorted(set(state) - expected)[:3]
        raise ExportError(
            f"the checkpoint's dense state does not fit the exported model (missing {missing}, extra {extra})"
        )
    fresh.load_state_dict(state, strict=True)
    return fresh


class DeltaFollower:
    """Polls ``run_dir`` and swaps each new checkpoint into ``model`` (see the module docstring)."""

    def __init__(
        self, model: ServingModel, run_dir: str | os.PathLike[str] | StoragePath, *, poll_seconds: float = 0.5
    ) -> None:
        self.model = model
        self.run_dir = location(run_dir)
        self.poll_seconds = poll_seconds
        self.failed: set[str] = set()
        self.applied: list[dict[str, float | str]] = []  # label, commit time, applied time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> str | None:
        """Apply the next checkpoint if there is one; returns the new version's label, else None."""
        try:
            refs, _ = scan(self.run_dir)
        except (CheckpointError, StorageError) as error:
            logger.warning("cannot list the checkpoints of %s: %s", self.run_dir, error)
            return None
        current = self.model.version
        step = next_checkpoint(
            refs,
            served_id=current.info["checkpoint_id"],
            served_step=int(current.info["step"]),
            failed=self.failed,
        )
        if step is None:
            return None
        try:
            version = self._build(current, step, refs)
        except (CheckpointError, ExportError, StorageError, ValueError) as error:
            self.failed.add(step.ref.checkpoint_id)
            logger.warning(
                "not applying checkpoint %s (still serving %s): %s", step.ref.name, current.label, error
            )
            return None
        self.model.swap(version)
        self.applied.append({"label": version.label, "committed": step.ref.created, "applied": time.time()})
        logger.info("serving %s (%s)", version.label, "delta" if step.as_delta else "rebuilt from its chain")
        return version.label

    def _build(self, current: ModelVersion, step: FollowStep, refs: list[CheckpointRef]) -> ModelVersion:
        ref = step.ref
        info = version_of(ref)
        held_by_replica: dict[str, Any] = current.tables  # ServingTable, or ShardedTable (lookup shards)
        sharded = {name: t for name, t in held_by_replica.items() if isinstance(t, ShardedTable)}
        local = sorted(set(current.tables) - set(sharded))
        # verifies every file read first; a rebuild with lookup shards leaves their tables to them
        data = load_checkpoint(ref, shards=[] if sharded and not step.as_delta else None)
        held = {key.partition("/")[0] for arrays in data.shards.values() for key in arrays}
        if data.shards and held != set(current.tables):
            raise ExportError(f"{ref.name} holds tables {sorted(held)}, the export {sorted(current.tables)}")
        tables: dict[str, Any] = {}
        if step.as_delta:  # new rows at the serving precision
            own = {index: only_tables(arrays, local) for index, arrays in data.shards.items()}
            tables.update(apply_delta_files({name: current.tables[name] for name in local}, own))
        else:
            tables.update(load_tables(chain_to(ref, refs), precision=self.model.precision, names=local))
        programs = {
            name: reweighted(program, data.dense["model"]) for name, program in current.programs.items()
        }
        # the lookup shards last: a version they hold before the replica swaps costs only memory
        tables.update(
            prepare_version(
                sharded,
                info["label"],
                base=current.label if step.as_delta else None,
                refs=[ref] if step.as_delta else chain_to(ref, refs),
            )
        )
        return ModelVersion(label=info["label"], info=info, tables=tables, programs=programs)

    # -- background thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="psrec-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception:  # a follower bug must not take the replica down: keep serving
                logger.exception(
                    "following %s failed; still serving %s", self.run_dir, self.model.version.label
                )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
