"""Retention: delete checkpoints older than the newest restorable chains, and torn-write leftovers.

What to delete is `psrec.checkpoint.policy.choose_retention` (a pure function); this module lists the
run's checkpoints, asks it, and deletes newest first, so an interrupted deletion still leaves complete
chains.
"""

from __future__ import annotations

import logging
import os
import shutil

from psrec.checkpoint import files
from psrec.checkpoint.format import MANIFEST_FILE, checkpoints_root
from psrec.checkpoint.load import cached_problems
from psrec.checkpoint.manifest import scan
from psrec.checkpoint.policy import choose_retention
from psrec.storage import Location, StoragePath, location

logger = logging.getLogger(__name__)


def apply_retention(
    run_dir: str | os.PathLike[str] | StoragePath,
    *,
    keep_last: int,
    verify_checksums: bool = True,
    pinned_step: int | None = None,
) -> list[Location]:
    """Delete checkpoints older than the newest ``keep_last`` restorable chains (`choose_retention`),
    plus leftovers of torn writes (temporary directories, directories never committed), so never call
    it while a checkpoint is pending (between `begin_checkpoint` and its commit). Returns the deleted
    paths. Checksums are verified newest first until ``keep_last`` restorable chains are found (cost:
    reading those files); ``verify_checksums=False`` judges by file presence and size only.
    ``pinned_step`` keeps the chain of that step's newest checkpoint too (the best model).
    """
    root = checkpoints_root(run_dir)
    refs, broken = scan(location(run_dir))
    problem_of = cached_problems(checksums=verify_checksums)
    decision = choose_retention(refs, keep_last=keep_last, problem_of=problem_of, pinned_step=pinned_step)
    doomed: list[Location] = [ref.path for ref in decision.delete]
    for path, _ in broken:
        step = int(path.name.split("-")[1])
        uncommitted = not (path / MANIFEST_FILE).exists()
        if uncommitted or (decision.keep_from_step is not None and step < decision.keep_from_step):
            doomed.append(path)
    deleted: list[Location] = []
    # Newest first: if this is interrupted, what is left is still complete chains.
    for path in sorted(doomed, key=lambda p: p.name, reverse=True):
        files.discard_directory(path, commit_marker=MANIFEST_FILE)
        deleted.append(path)
    if root.is_dir():
        entries: list[Location] = list(root.iterdir())
        for path in sorted(entries, key=lambda entry: entry.name):
            if path.name.startswith((files.TEMP_PREFIX, files.TRASH_PREFIX)):
                if isinstance(path, StoragePath):
                    path.rmtree() if path.is_dir() else path.unlink(missing_ok=True)
                else:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                deleted.append(path)
    if deleted:
        logger.info("retention (keep_last=%d) deleted %s", keep_last, ", ".join(p.name for p in deleted))
    return deleted
