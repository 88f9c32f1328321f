"""Tests for the pure checkpoint decisions: which chain to restore, what retention deletes, config diffs,
whether a failed run restarts.

No file system: histories are hand-made (or Hypothesis-made) `CheckpointRef` lists. The storage layer
that calls these is tested in ``tests/checkpoint/test_store.py``.

Run: ``python -m pytest tests/checkpoint/test_policy.py -q``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.checkpoint.files import fingerprint
from psrec.checkpoint.policy import (
    CheckpointRef,
    Kind,
    RestartDecision,
    checkpoint_chain,
    choose_restart,
    choose_restore_chain,
    choose_retention,
    diff_configs,
)

# ------------------------------------------------------------------------------------------ configs


def test_diff_configs() -> None:
    a = {"x": 1, "n": {"y": [1, 2, 3], "z": "s"}, "t": (1, 2), "gone": None}
    b = {"x": 1.0, "n": {"y": [1, 5, 3], "z": "s"}, "t": [1, 2], "new": {"k": 1}}
    assert diff_configs(a, b) == ["gone", "n.y[1]", "new", "x"]
    assert diff_configs(a, b, ignore=["n", "x"]) == ["gone", "new"]
    assert diff_configs(a, b, ignore=["n.*", "gone", "new"]) == ["x"]
    assert diff_configs({"y": [1, 2]}, {"y": [1, 2, 3]}) == ["y"]
    assert diff_configs({"a": {"b": 1}}, {"a": 2}) == ["a"]
    assert diff_configs({"flag": True}, {"flag": 1}) == ["flag"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(json_values, json_values)
def test_diff_configs_is_empty_exactly_when_the_fingerprints_match(a: Any, b: Any) -> None:
    assert diff_configs({"c": a}, {"c": a}) == []
    assert (diff_configs({"c": a}, {"c": b}) == []) == (fingerprint({"c": a}) == fingerprint({"c": b}))


# ------------------------------------------------------------------------------- restore and retention


def ref(
    step: int, kind: Kind, name: str, parent: str | None = None, base: str | None = None
) -> CheckpointRef:
    return CheckpointRef(
        path=Path(f"/nowhere/ckpt-{step:09d}-{kind}"),
        step=step,
        kind=kind,
        checkpoint_id=name,
        parent_id=parent,
        base_id=base,
    )


F1 = ref(10, "full", "F1")
D1 = ref(20, "delta", "D1", parent="F1", base="F1")
D2 = ref(30, "delta", "D2", parent="D1", base="F1")
F2 = ref(40, "full", "F2")
D3 = ref(50, "delta", "D3", parent="F2", base="F2")


def valid_except(*bad: str) -> Any:
    return lambda r: f"{r.checkpoint_id} is bad" if r.checkpoint_id in bad else None


def test_choose_restore_chain() -> None:
    refs = [D3, F1, D2, F2, D1]  # order does not matter
    assert choose_restore_chain(refs, valid_except()).chain == [F2, D3]
    decision = choose_restore_chain(refs, valid_except("F2"))
    assert decision.chain == [F1, D1, D2]
    assert decision.skipped == [(D3, "it needs ckpt-000000040-full, which is invalid"), (F2, "F2 is bad")]
    assert choose_restore_chain(refs, valid_except("F2", "D1")).chain == [F1]
    assert choose_restore_chain(refs, valid_except("F2", "F1")).chain == []
    assert choose_restore_chain([], valid_except()).chain == []
    broken = choose_restore_chain([F1, D2], valid_except())
    assert broken.chain == [F1] and "chain is broken" in broken.skipped[0][1]
    # A delta that claims another base than the full its parents lead to is never attached.
    stray = ref(60, "delta", "S", parent="D3", base="F1")
    assert (
        checkpoint_chain(stray, refs + [stray])
        == "its chain is inconsistent: the deltas do not all start from ckpt-000000040-full"
    )
    assert choose_restore_chain(refs + [stray], valid_except()).chain == [F2, D3]


def test_choose_restore_chain_asks_lazily_newest_first() -> None:
    asked: list[str] = []

    def problem_of(r: CheckpointRef) -> str | None:
        asked.append(r.checkpoint_id)
        return None

    choose_restore_chain([F1, D1, D2, F2, D3], problem_of)
    assert asked == ["F2", "D3"]


def test_choose_retention() -> None:
    refs = [F1, D1, D2, F2, D3]
    assert choose_retention(refs, keep_last=1, problem_of=valid_except()).delete == [F1, D1, D2]
    assert choose_retention(refs, keep_last=2, problem_of=valid_except()).delete == []
    assert choose_retention(refs, keep_last=1, problem_of=valid_except("D3")).delete == [F1, D1, D2]
    kept_old = choose_retention(refs, keep_last=1, problem_of=valid_except("F2"))
    assert kept_old.delete == [] and kept_old.keep_from_step == 10
    assert choose_retention(refs, keep_last=1, problem_of=valid_except("F1", "F2")).delete == []
    with pytest.raises(ValueError, match="keep_last"):
        choose_retention(refs, keep_last=0, problem_of=valid_except())
    # A stale full checkpoint (step 25) newer than the chain's base must not get that base deleted.
    stale = ref(25, "full", "STALE")
    assert choose_retention([F1, D1, stale, D2], keep_last=1, problem_of=valid_except()).delete == []


def test_retention_keeps_the_pinned_chain_and_restore_finds_it_by_step() -> None:
    refs = [F1, D1, D2, F2, D3]
    # The best model at step 20: its chain [F1, D1] stays, D2 (not needed by it) goes.
    assert choose_retention(refs, keep_last=1, problem_of=valid_except(), pinned_step=20).delete == [D2]
    assert choose_restore_chain(refs, valid_except(), at_step=20).chain == [F1, D1]
    assert choose_restore_chain(refs, valid_except(), at_step=25).chain == []
    # A pinned step whose chain is invalid pins nothing.
    assert choose_retention(refs, keep_last=1, problem_of=valid_except("D1"), pinned_step=20).delete == [
        F1,
        D1,
        D2,
    ]


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[CheckpointRef], set[str]]:
    """Random checkpoint histories, including stale branches and dangling parents, with random corruption."""
    refs: list[CheckpointRef] = []
    for step in range(1, draw(st.integers(0, 10)) + 1):
        parent = draw(st.none() | st.sampled_from(refs)) if refs else None
        if parent is None:
            refs.append(ref(step, "full", f"c{step}"))
        else:
            base = parent.checkpoint_id if parent.kind == "full" else parent.base_id
            refs.append(ref(step, "delta", f"c{step}", parent=parent.checkpoint_id, base=base))
    bad = draw(st.sets(st.sampled_from([r.checkpoint_id for r in refs]))) if refs else set()
    gone = draw(st.sets(st.sampled_from([r.checkpoint_id for r in refs]))) if refs else set()
    return [r for r in refs if r.checkpoint_id not in gone], bad


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(1, 3))
def test_retention_never_changes_what_would_be_restored(
    history: tuple[list[CheckpointRef], set[str]], keep_last: int
) -> None:
    refs, bad = history
    problem_of = valid_except(*bad)
    chosen = choose_restore_chain(refs, problem_of).chain
    assert all(problem_of(r) is None for r in chosen)
    if chosen:  # nothing newer than the chosen checkpoint has a complete valid chain
        for r in refs:
            chain = checkpoint_chain(r, refs)
            if r.step > chosen[-1].step and not isinstance(chain, str):
                assert any(problem_of(m) for m in chain)
    deleted = choose_retention(refs, keep_last=keep_last, problem_of=problem_of).delete
    remaining = [r for r in refs if r not in deleted]
    assert choose_restore_chain(remaining, problem_of).chain == chosen
    roots = {
        c[0].checkpoint_id
        for r in refs
        if not isinstance(c := checkpoint_chain(r, refs), str) and not any(problem_of(m) for m in c)
    }
    kept_roots = {
        c[0].checkpoint_id
        for r in remaining
        if not isinstance(c := checkpoint_chain(r, remaining), str) and not any(problem_of(m) for m in c)
    }
    assert len(kept_roots) >= min(keep_last, len(roots))


# ------------------------------------------------------------------------------------------ restarts


def test_choose_restart_recovers_when_an_actor_died() -> None:
    decision = choose_restart(actor_failure=True, dead_actors=["shard 1"], restarts=0, max_restarts=3)
    assert decision == RestartDecision(True, "actor died", "dead: shard 1; restart 1 of at most 3")
    last = choose_restart(
        actor_failure=True, dead_actors=["trainer 0", "shard 1"], restarts=2, max_restarts=3
    )
    assert last.recover and last.detail == "dead: trainer 0, shard 1; restart 3 of at most 3"


def test_choose_restart_reraises_an_error_of_a_live_process() -> None:
    # A bug or bad data: not an actor failure, whatever the actors' state and the restarts left.
    for dead in ([], ["trainer 0"]):
        decision = choose_restart(actor_failure=False, dead_actors=dead, restarts=0, max_restarts=3)
        assert not decision.recover and decision.reason == "not an actor failure"
    # An actor failure (e.g. an exception raised inside an actor) while every actor still answers.
    alive = choose_restart(actor_failure=True, dead_actors=[], restarts=0, max_restarts=3)
    assert not alive.recover and alive.reason == "no actor died"


def test_choose_restart_gives_up_after_max_restarts() -> None:
    decision = choose_restart(actor_failure=True, dead_actors=["shard 0"], restarts=3, max_restarts=3)
    assert decision == RestartDecision(
        False, "max restarts reached", "giving up after 3 restarts (fault_tolerance.max_restarts)"
    )
    never = choose_restart(actor_failure=True, dead_actors=["shard 0"], restarts=0, max_restarts=0)
    assert not never.recover and never.reason == "max restarts reached"
    # The checks run in order: an error of a live process is re-raised as such, even with no restarts left.
    assert choose_restart(actor_failure=False, dead_actors=[], restarts=5, max_restarts=3).reason == (
        "not an actor failure"
    )
