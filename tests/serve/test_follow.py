"""The delta follower: each committed checkpoint is applied whole (scores equal an export of that
checkpoint), a request never mixes two versions, and a corrupt delta is not applied."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec import checkpoint
from psrec.serve.follow import DeltaFollower, next_checkpoint
from psrec.serve.requests import parse_request
from psrec.serve.scoring import ServingModel
from tests.serve.test_export import _raw_rows


@pytest.fixture(scope="module")
def rows(deepfm_run: dict[str, Any]) -> list[dict[str, Any]]:
    return _raw_rows(deepfm_run["sources"]["validation"]["paths"])[:500]


def _scores(model: ServingModel, rows: list[dict[str, Any]]) -> tuple[str, np.ndarray]:
    out = model.score_requests([parse_request({"rows": rows}, model.request_spec)])[0]
    return out["version"], np.asarray(out["scores"])


def test_following_applies_each_checkpoint_as_its_own_export(
    deepfm_run: dict[str, Any], rows: list[dict[str, Any]], exported: Any
) -> None:
    run_dir = deepfm_run["run_dir"]
    refs = checkpoint.list_checkpoints(run_dir)
    assert [ref.kind for ref in refs][:2] == ["full", "delta"]
    model = ServingModel.load(exported(run_dir, checkpoint=refs[0].name))
    follower = DeltaFollower(model, run_dir)
    for ref in refs[1:]:
        label = follower.poll()
        assert label is not None and label.endswith(ref.checkpoint_id[:8]), (label, ref.name)
        version, served = _scores(model, rows)
        assert version == label
        expected = _scores(ServingModel.load(exported(run_dir, checkpoint=ref.name)), rows)[1]
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
    assert follower.poll() is None  # nothing newer


def test_a_request_is_scored_by_one_version_while_versions_swap(
    deepfm_run: dict[str, Any], rows: list[dict[str, Any]], exported: Any
) -> None:
    run_dir = deepfm_run["run_dir"]
    refs = checkpoint.list_checkpoints(run_dir)
    expected = {}
    for ref in refs:
        label, scores = _scores(ServingModel.load(exported(run_dir, checkpoint=ref.name)), rows)
        expected[label] = scores
    served = ServingModel.load(exported(run_dir, checkpoint=refs[0].name))
    follower = DeltaFollower(served, run_dir)
    seen: list[tuple[str, np.ndarray]] = []
    done = threading.Event()

    def score_until_done() -> None:
        while not done.is_set() and len(seen) < 200:
            seen.append(_scores(served, rows))

    thread = threading.Thread(target=score_until_done)
    thread.start()
    try:
        while follower.poll() is not None:
            pass
    finally:
        done.set()
        thread.join(timeout=60)
    seen.append(_scores(served, rows))
    assert {label for label, _ in seen} <= set(expected)
    assert len({label for label, _ in seen}) >= 2  # requests ran while versions were swapped
    assert seen[-1][0] == list(expected)[-1]
    for label, scores in seen:
        np.testing.assert_allclose(scores, expected[label], rtol=0, atol=1e-6)


def test_a_corrupt_delta_is_not_applied_and_the_previous_version_keeps_serving(
    deepfm_run: dict[str, Any], rows: list[dict[str, Any]], tmp_path: Path, exported: Any
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(deepfm_run["run_dir"], run_dir)
    refs = checkpoint.list_checkpoints(run_dir)
    model = ServingModel.load(exported(deepfm_run["run_dir"], checkpoint=refs[0].name))
    before = _scores(model, rows)
    shard = refs[1].path / "shard-0.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, another sha256
    shard.write_bytes(bytes(data))
    follower = DeltaFollower(model, run_dir)
    for _ in range(len(refs)):
        assert follower.poll() is None  # the later deltas' chains run through the corrupt one
    after = _scores(model, rows)
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    assert refs[1].checkpoint_id in follower.failed


def test_next_checkpoint_prefers_the_delta_of_the_served_one() -> None:
    from psrec.checkpoint.policy import CheckpointRef

    def ref(step: int, kind: str, ident: str, parent: str | None) -> CheckpointRef:
        return CheckpointRef(
            path=Path(ident),
            step=step,
            kind=kind,
            checkpoint_id=ident,
            parent_id=parent,
            base_id=None,
            created=0.0,
        )

    refs = [ref(0, "full", "a", None), ref(10, "delta", "b", "a"), ref(20, "delta", "c", "b")]
    step = next_checkpoint(refs, served_id="a", served_step=0, failed=set())
    assert step is not None and step.ref.checkpoint_id == "b" and step.as_delta
    step = next_checkpoint(refs, served_id="a", served_step=0, failed={"b"})
    assert step is not None and step.ref.checkpoint_id == "c" and not step.as_delta
    assert next_checkpoint(refs, served_id="c", served_step=20, failed=set()) is None
