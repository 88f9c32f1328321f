"""Trainer-count requests that cannot be carried out, and the pure decisions of a trainer change.

No Ray: `psrec scale --trainers` refuses on the run's config.json; the driver's controller refuses
on its config, the cluster's free CPUs (a stand-in for Ray's count) and a change in progress, and
writes the reason to scale.json with nothing changed. `dealt_states` is checked against a plain
oracle: the readers it opens read exactly the rows the old readers had left.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from psrec.cli import main
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import criteo_schema
from psrec.data.units import OFFSET_BITS
from psrec.elastic import trainer_scaling
from psrec.elastic.resharding import (
    DRIVER_FILE,
    REQUEST_FILE,
    STATUS_FILE,
    ScaleController,
    ScaleError,
    request_scale,
)
from psrec.elastic.trainer_scaling import count_error, dealt_states
from tests.conftest import small_run_config


def ray_settings(**overrides: Any) -> dict[str, Any]:
    return {"ps.runtime": "ray", "ps.num_trainers": 2, "fault_tolerance.shard_failover": False, **overrides}


def run_dir_of(tmp_path: Path, sources: dict[str, Any], **overrides: Any) -> tuple[Path, Any]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    config = small_run_config(sources, run_dir, **ray_settings(**overrides))
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    (run_dir / DRIVER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return run_dir, config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ps.runtime": "local", "ps.num_trainers": 1}, "the in-process runtime runs one trainer"),
        ({"ps.strategy": "collective"}, "strategy 'collective'"),
    ],
)
def test_psrec_scale_refuses_trainers_for_a_config_that_cannot_change_them(
    synthetic_sources: dict[str, Any], tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    run_dir, _ = run_dir_of(tmp_path, synthetic_sources, **overrides)
    with pytest.raises(ScaleError, match=message):
        request_scale(str(run_dir), trainers=3)
    assert not (run_dir / REQUEST_FILE).exists()


def test_psrec_scale_refuses_a_bad_trainer_count_and_a_second_request(
    synthetic_sources: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run_dir_of(tmp_path, synthetic_sources)
    for count in (0, -2):
        with pytest.raises(ScaleError, match=f"--trainers {count}: trainers must be an integer >= 1"):
            request_scale(str(run_dir), trainers=count)
    with pytest.raises(ScaleError, match="give the new count"):
        request_scale(str(run_dir))
    assert main(["scale", str(run_dir), "--trainers", "0"]) == 2
    assert "trainers must be an integer >= 1" in capsys.readouterr().err
    assert not (run_dir / REQUEST_FILE).exists()
    assert main(["scale", str(run_dir), "--trainers", "3", "--shards", "4"]) == 0
    written = json.loads((run_dir / REQUEST_FILE).read_text())
    assert (written["trainers"], written["shards"]) == (3, 4)
    with pytest.raises(ScaleError, match=r"\(to 4 shards, 3 trainers\) waits for the driver"):
        request_scale(str(run_dir), trainers=1)
    (run_dir / REQUEST_FILE).unlink()
    current = {"id": "x", "trainers": 3, "state": "starting"}
    (run_dir / STATUS_FILE).write_text(json.dumps({"current": current, "history": []}))
    with pytest.raises(ScaleError, match=r"changing to 3 trainers is in progress \(starting\)"):
        request_scale(str(run_dir), trainers=1)


class FakeRuntime:
    """What the controller reads of a Ray runtime, without Ray: its config and trainers."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.trainers = [object(), object()]

    @property
    def num_trainers(self) -> int:
        return len(self.trainers)

    def shard_set(self) -> None:
        return None  # the test sets the controller's shards itself


class FakeShards:
    """Two shards, as the controller counts them."""

    def count(self) -> int:
        return 2

    def abandon(self) -> None:
        pass


class NeverReady:
    """A trainer change whose added trainers never answer (it stays in progress)."""

    started: list[int] = []

    def __init__(self, runtime: Any, count: int) -> None:
        self.count = count

    def start(self) -> None:
        NeverReady.started.append(self.count)

    def advance(self, step: int) -> tuple[str, None]:
        return "waiting", None

    def abandon(self) -> None:
        pass


def test_the_driver_refuses_what_it_cannot_do_and_writes_why(
    synthetic_sources: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    run_dir, config = run_dir_of(tmp_path, synthetic_sources)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 1.0})  # one CPU free
    monkeypatch.setattr(trainer_scaling, "TrainerChange", NeverReady)
    controller = ScaleController(str(run_dir), config, FakeRuntime(config))
    controller.shards = FakeShards()  # type: ignore[assignment]
    requests = [
        {"id": "zero", "trainers": 0},
        {"id": "too-many", "trainers": 4},  # 2 more CPUs than the one free
        {"id": "with-shards", "trainers": 3, "shards": 3},  # 1 trainer + 1 shard: 2 CPUs
        {"id": "grow", "trainers": 3},
    ]
    for step, request in enumerate(requests):
        (run_dir / REQUEST_FILE).write_text(json.dumps(request))
        assert controller.poll(step) is False
    (run_dir / REQUEST_FILE).write_text(json.dumps({"id": "second", "trainers": 1}))
    controller.poll(len(requests))
    status = json.loads((run_dir / STATUS_FILE).read_text())
    handled = {entry["id"]: entry for entry in status["history"]}
    assert "trainers must be an integer >= 1, got 0" in handled["zero"]["message"]
    assert "4 trainers need 2 more CPUs" in handled["too-many"]["message"]
    assert "3 trainers need 1 more CPUs" in handled["with-shards"]["message"]
    left = 1.0 - config.ps.shard_resources.num_cpus  # the added shard takes its CPUs first
    assert f"cluster has {left:g} free" in handled["with-shards"]["message"]
    assert (
        handled["second"]["state"] == "refused"
        and "changing to 3 trainers is in progress" in (handled["second"]["message"])
    )
    assert all(handled[name]["state"] == "refused" for name in ("zero", "too-many", "with-shards"))
    assert status["current"]["id"] == "grow" and status["current"]["state"] == "starting"
    assert NeverReady.started == [3]  # only the acceptable request started anything
    controller.end()
    assert json.loads((run_dir / STATUS_FILE).read_text())["history"][-1]["state"] == "stopped"


def test_count_error_counts_the_cpus_of_added_trainers_only() -> None:
    assert count_error(3, current=2, free_cpus=1.0, cpus_per_trainer=1.0) is None
    assert count_error(1, current=2, free_cpus=0.0, cpus_per_trainer=1.0) is None  # removing needs none
    assert count_error(True, current=2, free_cpus=None, cpus_per_trainer=1.0) is not None
    assert "5 trainers need 3 more CPUs" in str(
        count_error(5, current=2, free_cpus=2.0, cpus_per_trainer=1.0)
    )


def test_dealt_states_open_readers_that_read_the_rows_left_once(synthetic_sources: dict[str, Any]) -> None:
    """Two trainers read 3 and 5 batches; the states dealt to 3 trainers read the rest, each row once."""
    source = DataSource.model_validate(synthetic_sources["train"])
    seen, states = [], []

    def reader_of(shard: int, num_shards: int, position: Any = None) -> Any:
        return open_reader(
            source,
            criteo_schema(),
            batch_size=300,
            shard=shard,
            num_shards=num_shards,
            shuffle_buffer=1500,
            seed=5,
            position=position,
        )

    for shard, batches in enumerate((3, 5)):
        with reader_of(shard, 2) as reader:
            for count, batch in enumerate(reader, start=1):
                seen.append(batch.row_ids)
                if count == batches:
                    break
            states.append({"trainer": shard, "step": 8, "epoch": 0, "position": reader.position()})
    dealt = dealt_states(json.loads(json.dumps(states)), 3)  # through JSON, as a checkpoint keeps them
    assert [(s["trainer"], s["step"], s["epoch"]) for s in dealt] == [(0, 8, 0), (1, 8, 0), (2, 8, 0)]
    for state in dealt:
        with reader_of(state["trainer"], 3, state["position"]) as reader:
            seen.extend(batch.row_ids for batch in reader)
    rows = np.concatenate(seen)
    files = sorted(Path(source.paths[0]).parent.glob("*.parquet"))
    expected = np.concatenate(
        [(i << OFFSET_BITS) + np.arange(pq.ParquetFile(f).metadata.num_rows) for i, f in enumerate(files)]
    )
    assert rows.size == expected.size and np.array_equal(np.sort(rows), np.sort(expected))
    assert dealt_states(states, 2) is states  # the same count: untouched
    with pytest.raises(ValueError, match="different steps"):
        dealt_states([states[0], {**states[1], "step": 9}], 1)


def test_the_trainer_count_is_part_of_the_resume_fingerprint_only_where_it_shapes_the_state(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    def fingerprint(**overrides: Any) -> str:
        return small_run_config(synthetic_sources, tmp_path, **ray_settings(**overrides)).fingerprint()

    assert fingerprint(**{"ps.num_trainers": 1}) == fingerprint(**{"ps.num_trainers": 3})
    collective = {"ps.strategy": "collective"}
    assert fingerprint(**collective, **{"ps.num_trainers": 1}) != fingerprint(
        **collective, **{"ps.num_trainers": 2}
    )
