"""The run directory: psrec writes into, resumes from, or moves aside only directories it created.

A run directory carries a marker file (`MARKER`) written when psrec creates it (or adopts an empty
directory). Before training starts:

- the file system root, the home directory, the working directory and any directory above it are
  refused (a run would write next to the user's own files);
- an existing directory without the marker is used only when it is empty; a non-empty one is
  refused, whatever it holds (a ``summary.json`` written by another tool included);
- a psrec run directory that holds a finished run (``summary.json``) is moved aside to
  ``RUN_DIR-<UTC time>`` when the run is not resumed; one with checkpoints is resumed.

A run directory may be a store URI (``s3://bucket/runs/x``, `psrec.storage`): the marker is an object
there and the rules are the same, except that a bucket's root is refused, and a finished run is not
moved aside (object stores cannot rename a directory): resume it or choose another run_dir. A store
that cannot be reached or read is a `ConfigError` naming the URI, before anything is written.

`inspect_run_dir` reads the directory, `plan_run_dir` decides (a pure function, tested on hand-made
states) and `apply_run_dir_plan` acts, after the rest of the run's set-up has succeeded.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from psrec.config import ConfigError
from psrec.storage import Location, StorageError, StoragePath, location

logger = logging.getLogger(__name__)

MARKER = ".psrec-run"


@dataclass(frozen=True)
class RunDirState:
    """What is at the run directory's path (plain data)."""

    path: Location
    resolved: Location
    exists: bool
    is_dir: bool
    entries: tuple[str, ...]  # names in the directory, sorted
    has_checkpoints: bool
    protected: str | None  # why the path must never be a run directory ("the home directory", ...)


@dataclass(frozen=True)
class RunDirPlan:
    path: Location
    resume: bool
    archive_to: Location | None  # move the finished run there first
    create: bool  # make the directory and write the marker (a new or an adopted empty directory)


def inspect_run_dir(path: str | Path | StoragePath, *, has_checkpoints: bool) -> RunDirState:
    run_dir = location(path)
    if isinstance(run_dir, StoragePath):
        try:
            is_dir = run_dir.is_dir()
            exists = is_dir or run_dir.exists()
            entries = tuple(sorted(p.name for p in run_dir.iterdir())) if is_dir else ()
        except StorageError as error:
            raise ConfigError(f"run_dir {run_dir.uri!r} cannot be read: {error}") from None
        protected = "the root of a bucket" if run_dir.is_bucket_root else None
        return RunDirState(run_dir, run_dir, exists, is_dir, entries, has_checkpoints, protected)
    resolved = run_dir.expanduser().resolve()
    exists = run_dir.exists()
    is_dir = run_dir.is_dir()
    entries = tuple(sorted(p.name for p in run_dir.iterdir())) if is_dir else ()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    protected = None
    if resolved == Path(resolved.anchor):
        protected = "the file system root"
    elif resolved == home:
        protected = "the home directory"
    elif resolved == cwd or resolved in cwd.parents:
        protected = "the working directory" if resolved == cwd else "a directory above the working directory"
    return RunDirState(run_dir, resolved, exists, is_dir, entries, has_checkpoints, protected)


def plan_run_dir(state: RunDirState, *, resume: bool | None, now: datetime | None = None) -> RunDirPlan:
    """What to do with the run directory (see the module docstring); raises ConfigError to refuse it.

    ``resume``: None resumes an interrupted run and moves a finished one aside; True resumes from the
    newest valid checkpoint; False refuses a directory that already holds checkpoints.
    """
    where = f"run_dir {str(state.path)!r}"
    if state.protected is not None:
        raise ConfigError(
            f"{where} is {state.protected} ({state.resolved}): psrec writes checkpoints, TensorBoard logs "
            "and a summary there. Give the run a directory of its own, e.g. runs/my-run."
        )
    if state.exists and not state.is_dir:
        raise ConfigError(f"{where} exists and is not a directory: choose another run_dir")
    ours = MARKER in state.entries
    if state.exists and state.entries and not ours:
        shown = ", ".join(state.entries[:5]) + (", ..." if len(state.entries) > 5 else "")
        raise ConfigError(
            f"{where} is not empty ({shown}) and was not created by psrec (no {MARKER} marker): psrec "
            "does not write into or move directories it did not create. Choose a new or empty run_dir "
            f"(a run directory of an earlier psrec version: create the marker, `touch {state.path / MARKER}`)."
        )
    if not ours:  # new or empty: nothing to resume (resume=True then starts from scratch)
        return RunDirPlan(state.path, resume=bool(resume), archive_to=None, create=True)
    if resume is None and "summary.json" in state.entries:
        if isinstance(state.path, StoragePath):
            raise ConfigError(
                f"{where} holds a finished run, and an object store cannot move it aside: resume it "
                "(--resume) or choose another run_dir"
            )
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        archive = state.path.with_name(f"{state.path.name}-{stamp}")
        return RunDirPlan(state.path, resume=False, archive_to=archive, create=True)
    if resume is False and state.has_checkpoints:
        raise ConfigError(
            f"{where} already holds checkpoints: resume it (--resume) or choose another run_dir"
        )
    return RunDirPlan(
        state.path, resume=state.has_checkpoints if resume is None else resume, archive_to=None, create=False
    )


def apply_run_dir_plan(plan: RunDirPlan) -> None:
    """Move a finished run aside, create the directory and its marker, as `plan` says."""
    if isinstance(plan.path, StoragePath):
        if plan.create:
            try:
                (plan.path / MARKER).write_text("psrec run directory\n")
            except StorageError as error:
                raise ConfigError(f"run_dir {plan.path.uri!r} cannot be written: {error}") from None
        return
    if plan.archive_to is not None:
        if plan.archive_to.exists():
            raise ConfigError(f"cannot move the finished run in {plan.path} aside: {plan.archive_to} exists")
        plan.path.rename(str(plan.archive_to))
        logger.info("%s held a finished run: moved it to %s", plan.path, plan.archive_to)
    if plan.create:
        plan.path.mkdir(parents=True, exist_ok=True)
        (plan.path / MARKER).write_text("psrec run directory\n")


def write_text(path: Location, text: str) -> None:
    """Write a run file (config.json, summary.json); a store that refuses it is a ConfigError."""
    try:
        path.write_text(text)
    except StorageError as error:
        raise ConfigError(f"cannot write {path}: {error}") from None


def upload_events(local: Path, run_dir: Location) -> None:
    """Copy the TensorBoard event files of a run whose run_dir is in a store to RUN_DIR/tensorboard."""
    from psrec import storage

    try:
        if (local / "tensorboard").is_dir():
            storage.copy_tree(local / "tensorboard", run_dir / "tensorboard")
    except StorageError as error:
        logger.warning("TensorBoard event files stay in %s: %s", local, error)
        return
    shutil.rmtree(local, ignore_errors=True)
