"""Pure decisions about checkpoints: which chain to restore, what retention deletes, how configs differ,
and whether a failed run restarts from its last checkpoint (`choose_restart`).

No file system here (the rest of `psrec.checkpoint` does the I/O and calls these), so every rule is unit-tested
on hand-made `CheckpointRef` lists. A chain is ``[full, delta1, ..., deltaN]``: each delta names its
``parent`` (previous checkpoint) and ``base`` (the full checkpoint) by unique checkpoint id, so a stale
delta left by an abandoned timeline never attaches to a newer checkpoint that reuses a name.

Tests: ``python -m pytest tests/checkpoint/test_policy.py -q``.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from psrec.checkpoint.files import canonical_json
from psrec.storage import Location

Kind = Literal["full", "delta"]


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint, as listed from its manifest. Plain data: the decisions take lists of these."""

    path: Location  # a local Path or a StoragePath (s3://...)
    step: int
    kind: Kind
    checkpoint_id: str
    parent_id: str | None = None
    base_id: str | None = None
    created: float = 0.0  # unix seconds

    @property
    def name(self) -> str:
        return self.path.name


# ---------------------------------------------------------------------------------------------- configs


def diff_configs(a: dict[str, Any], b: dict[str, Any], *, ignore: Collection[str] = ()) -> list[str]:
    """Dotted paths (``model.layers[1]``) whose values differ between two JSON-able configs, sorted.

    A path is skipped when it equals an ``ignore`` entry, lies below one (``"logging"`` covers
    ``"logging.every"``), or matches one as an fnmatch pattern (``"train.*_steps"``). Values are compared
    as JSON, so tuples equal lists but ``1`` differs from ``1.0``.
    """
    return [path for path, _, _ in config_differences(a, b, ignore=ignore)]


MISSING = object()


def config_differences(a: Any, b: Any, *, ignore: Collection[str] = ()) -> list[tuple[str, Any, Any]]:
    """`diff_configs` with the two values at each path (`MISSING` where a side lacks the field)."""
    out: list[tuple[str, Any, Any]] = []
    _walk(json.loads(canonical_json(a)), json.loads(canonical_json(b)), "", out)
    return sorted((d for d in out if not _ignored(d[0], ignore)), key=lambda d: d[0])


def _walk(a: Any, b: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            _walk(a.get(key, MISSING), b.get(key, MISSING), sub, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{index}]", out)
    elif a is MISSING or b is MISSING or canonical_json(a) != canonical_json(b):
        out.append((path or "<root>", a, b))


def _ignored(path: str, ignore: Collection[str]) -> bool:
    return any(
        path == p or path.startswith((f"{p}.", f"{p}[")) or fnmatch.fnmatchcase(path, p) for p in ignore
    )


def show_value(value: Any) -> str:
    text = "<missing>" if value is MISSING else canonical_json(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -------------------------------------------------------------------------------- decisions (pure)


def checkpoint_order(ref: CheckpointRef) -> tuple[int, float, str]:
    """Sort key, oldest first: step, then creation time (a replaced step), then name."""
    return (ref.step, ref.created, ref.name)


def checkpoint_chain(ref: CheckpointRef, refs: Sequence[CheckpointRef]) -> list[CheckpointRef] | str:
    """``[full, delta1, ..., ref]`` following parent links through ``refs``, or why that is impossible."""
    by_id = {r.checkpoint_id: r for r in refs}
    chain = [ref]
    while chain[-1].kind == "delta":
        child = chain[-1]
        parent = by_id.get(child.parent_id or "")
        if parent is None:
            return f"its chain is broken: {child.name}'s parent checkpoint is gone"
        if checkpoint_order(parent) >= checkpoint_order(child):
            return f"its chain is inconsistent: {child.name}'s parent {parent.name} is not older"
        chain.append(parent)
    chain.reverse()
    root = chain[0]
    if any(member.base_id != root.checkpoint_id for member in chain[1:]):
        return f"its chain is inconsistent: the deltas do not all start from {root.name}"
    return chain


@dataclass(frozen=True)
class RestoreDecision:
    chain: list[CheckpointRef]  # [full, delta1, ...], oldest first; [] when nothing is restorable
    skipped: list[tuple[CheckpointRef, str]]  # newer checkpoints passed over, and why


def choose_restore_chain(
    refs: Sequence[CheckpointRef],
    problem_of: Callable[[CheckpointRef], str | None],
    *,
    at_step: int | None = None,
) -> RestoreDecision:
    """The newest checkpoint whose whole chain is present and valid (``problem_of(member)`` is None);
    with ``at_step``, the newest such checkpoint of that step (e.g. the best model's).

    ``problem_of`` is asked lazily, newest first, so a caller that verifies checksums in it only reads
    the checkpoints it needs.
    """
    skipped: list[tuple[CheckpointRef, str]] = []
    candidates = [ref for ref in refs if at_step is None or ref.step == at_step]
    for ref in sorted(candidates, key=checkpoint_order, reverse=True):
        chain = checkpoint_chain(ref, refs)
        if isinstance(chain, str):
            skipped.append((ref, chain))
            continue
        problems = [(member, problem_of(member)) for member in chain]
        bad = [(member, problem) for member, problem in problems if problem is not None]
        if not bad:
            return RestoreDecision(chain=chain, skipped=skipped)
        member, problem = bad[-1]
        skipped.append((ref, problem if member is ref else f"it needs {member.name}, which is invalid"))
    return RestoreDecision(chain=[], skipped=skipped)


@dataclass(frozen=True)
class RetentionDecision:
    delete: list[CheckpointRef]  # oldest first
    keep_from_step: int | None  # steps below this are deletable; None when nothing is restorable


def choose_retention(
    refs: Sequence[CheckpointRef],
    *,
    keep_last: int,
    problem_of: Callable[[CheckpointRef], str | None],
    pinned_step: int | None = None,
) -> RetentionDecision:
    """Keep the newest ``keep_last`` restorable chains (counted by their full checkpoint) and everything
    newer than the oldest of them; delete the rest. Deletes nothing when no chain is restorable, so the
    only valid checkpoint, and any full checkpoint a kept delta needs, always stays. ``pinned_step``
    also keeps the newest restorable chain of that step (the best model under early stopping).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    roots: list[CheckpointRef] = []
    for ref in sorted(refs, key=checkpoint_order, reverse=True):
        chain = checkpoint_chain(ref, refs)
        if isinstance(chain, str) or any(problem_of(member) is not None for member in chain):
            continue
        if chain[0] not in roots:
            roots.append(chain[0])
            if len(roots) == keep_last:
                break
    if not roots:
        return RetentionDecision(delete=[], keep_from_step=None)
    oldest = min(roots, key=checkpoint_order)
    pinned = set()
    if pinned_step is not None:
        pinned = {
            ref.checkpoint_id for ref in choose_restore_chain(refs, problem_of, at_step=pinned_step).chain
        }
    delete = [
        ref
        for ref in sorted(refs, key=checkpoint_order)
        if checkpoint_order(ref) < checkpoint_order(oldest) and ref.checkpoint_id not in pinned
    ]
    return RetentionDecision(delete=delete, keep_from_step=oldest.step)


# ------------------------------------------------------------------------------- restarts (pure)

RestartReason = Literal["actor died", "not an actor failure", "no actor died", "max restarts reached"]


@dataclass(frozen=True)
class RestartDecision:
    """Whether a failed run rolls back to its last checkpoint and goes on (`recover`), and why."""

    recover: bool
    reason: RestartReason
    detail: str  # the reason in a sentence, for the log


def choose_restart(
    *,
    actor_failure: bool,
    dead_actors: Sequence[str],
    restarts: int,
    max_restarts: int,
    failovers: int = 0,
) -> RestartDecision:
    """Recover from a failure only when a process died, at most ``max_restarts`` times in a run.

    ``actor_failure``: the error came from the actor system (the caller's test, e.g. Ray's
    ``RayError``), not from code raising inside a live process; ``dead_actors``: names of the
    processes that no longer answer; ``restarts``: recoveries (rollbacks) so far; ``failovers``:
    shards rebuilt alone from their logs so far (`psrec.elastic.shard_failover`), which spend the same
    budget. An exception raised inside a live process (a bug or bad data) is re-raised: replaying
    the steps would fail the same way.
    """
    if not actor_failure:
        return RestartDecision(
            False, "not an actor failure", "raised inside a live process: replaying would fail the same way"
        )
    if not dead_actors:
        return RestartDecision(False, "no actor died", "an actor call failed, but every actor still answers")
    spent = restarts + failovers
    rebuilt = f" and {failovers} shard failovers" if failovers else ""
    if spent >= max_restarts:
        return RestartDecision(
            False,
            "max restarts reached",
            f"giving up after {restarts} restarts{rebuilt} (fault_tolerance.max_restarts)",
        )
    return RestartDecision(
        True,
        "actor died",
        f"dead: {', '.join(dead_actors)}; restart {spent + 1} of at most {max_restarts}"
        + (f" (after {failovers} shard failovers)" if failovers else ""),
    )
