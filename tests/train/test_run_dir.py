"""The run directory: psrec writes into, resumes from or moves aside only directories it created."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from psrec.config import ConfigError
from psrec.train.loop import train
from psrec.train.run_dir import MARKER, RunDirState, inspect_run_dir, plan_run_dir


def state(
    path: str = "runs/a", *, entries: tuple[str, ...] = (), exists: bool = True, **kw: Any
) -> RunDirState:
    values: dict[str, Any] = {
        "path": Path(path),
        "resolved": Path("/work") / path,
        "exists": exists,
        "is_dir": exists,
        "entries": entries,
        "has_checkpoints": False,
        "protected": None,
    }
    return RunDirState(**(values | kw))


def test_plan_new_empty_ours_finished_and_interrupted() -> None:
    new = plan_run_dir(state(exists=False), resume=None)
    assert new.create and not new.resume and new.archive_to is None
    assert plan_run_dir(state(), resume=None).create  # an empty directory is adopted
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    finished = plan_run_dir(state(entries=(MARKER, "summary.json")), resume=None, now=now)
    assert finished.archive_to == Path("runs/a-20260102-030405") and finished.create and not finished.resume
    interrupted = plan_run_dir(state(entries=(MARKER, "checkpoints"), has_checkpoints=True), resume=None)
    assert interrupted.resume and not interrupted.create and interrupted.archive_to is None
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        plan_run_dir(state(entries=(MARKER, "checkpoints"), has_checkpoints=True), resume=False)


@pytest.mark.parametrize("entries", [("summary.json",), ("notes.txt", "summary.json"), ("config.json",)])
def test_plan_refuses_a_non_empty_directory_psrec_did_not_create(entries: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="was not created by psrec"):
        plan_run_dir(state(entries=entries), resume=None)


@pytest.mark.parametrize("where", ["the file system root", "the home directory", "the working directory"])
def test_plan_refuses_protected_directories(where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        plan_run_dir(state(protected=where), resume=None)


def test_inspect_names_protected_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert inspect_run_dir(".", has_checkpoints=False).protected == "the working directory"
    assert inspect_run_dir("/", has_checkpoints=False).protected == "the file system root"
    assert inspect_run_dir(Path.home(), has_checkpoints=False).protected == "the home directory"
    assert inspect_run_dir(tmp_path.parent, has_checkpoints=False).protected is not None
    assert inspect_run_dir("runs/x", has_checkpoints=False).protected is None


def _config(sources: dict[str, Any], run_dir: Path | str, **overrides: Any) -> Any:
    from tests.conftest import small_run_config

    return small_run_config(sources, Path(run_dir), **({"training.max_steps": 2} | overrides))


@pytest.mark.parametrize("run_dir", [".", "/"])
def test_train_refuses_the_working_directory_and_the_root(
    run_dir: str, synthetic_sources: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="run_dir"):
        train(_config(synthetic_sources, run_dir))
    assert sorted(os.listdir(tmp_path)) == []


def test_train_leaves_a_foreign_directory_as_it_was(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """A directory holding another tool's summary.json and config.json is neither renamed nor written."""
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "summary.json").write_text('{"tool": "other"}')
    (foreign / "config.json").write_text('{"mine": true}')
    with pytest.raises(ConfigError, match="not created by psrec"):
        train(_config(synthetic_sources, foreign))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert json.loads((foreign / "config.json").read_text()) == {"mine": True}
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", "summary.json"]


def test_a_failed_set_up_does_not_touch_the_run_directory(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """The runtime fails to start (an unreachable Ray address): no run directory is created."""
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="does not answer"):
        train(_config(synthetic_sources, run_dir, **{"ps.runtime": "ray", "ps.address": "127.0.0.1:9"}))
    assert not run_dir.exists()


def test_train_creates_marks_resumes_and_archives_its_own_directory(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    first = train(_config(synthetic_sources, run_dir))
    assert (run_dir / MARKER).exists() and first["steps"] == 2
    second = train(_config(synthetic_sources, run_dir))  # finished: moved aside, a new run starts
    archived = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    assert len(archived) == 1 and (archived[0] / "summary.json").exists() and second["resumed_from"] is None
