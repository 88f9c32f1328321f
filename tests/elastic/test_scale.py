"""Changing the shard count while training, in process: `psrec scale` requests picked up between steps.

The oracle is the same run, undisturbed, on 2 shards (sync mode; a row starts from a function of
(seed, id), so any shard count trains the same model): the run resharded 2 -> 3 -> 1 while it
trains must end with every table row, every dense weight and the validation AUC equal, bit for bit.
Bad requests sent to the same run are refused with their reason and move nothing (the model still
equals the oracle's), and every checkpoint written before, during and after the moves restores into
2 and 3 shards as the oracle's checkpoint of the same step does.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.checkpoint import list_checkpoints, read_manifest, resolve_restore_chain
from psrec.cli import main
from psrec.elastic.resharding import (
    DRIVER_FILE,
    REQUEST_FILE,
    STATUS_FILE,
    ScaleError,
    request_scale,
    wait_for,
)
from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config

SETTINGS = {
    "training.max_steps": 60,
    "training.log_every_steps": 5,
    "checkpoint.every_steps": 10,
    "checkpoint.full_every": 3,
    "checkpoint.keep_last": 20,
}


def run(
    sources: dict[str, Any], run_dir: Path, progress: Any = None, *, mode: str = "sync"
) -> tuple[dict[str, Any], Any]:
    config = small_run_config(sources, run_dir, **SETTINGS, **{"ps.mode": mode})
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train(config, runtime=runtime, progress=progress, resume=False)
        return summary, (runtime.dense_states()[0], runtime.table_rows(), len(runtime.shards))
    finally:
        runtime.shutdown()


def assert_same_tables(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for table, (ids, values) in expected.items():
        np.testing.assert_array_equal(got[table][0], ids, err_msg=table)
        np.testing.assert_array_equal(got[table][1], values, err_msg=table)


def restored_rows(
    sources: dict[str, Any], run_dir: Path, step: int, shards: int, mode: str
) -> dict[str, Any]:
    """The tables of `run_dir`'s checkpoint chain of `step`, restored into `shards` shards."""
    config = small_run_config(sources, run_dir, **SETTINGS, **{"ps.num_shards": shards, "ps.mode": mode})
    chain = resolve_restore_chain(str(run_dir), config=config.fingerprint_dict(), at_step=step)
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        runtime.restore(chain)
        return runtime.table_rows()
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resharding_2_to_3_to_1_while_training_ends_with_the_undisturbed_model(
    synthetic_sources: dict[str, Any], tmp_path: Path, mode: str
) -> None:
    """In process, one trainer: async mode is deterministic too (one caller, calls in order)."""
    oracle_summary, (oracle_dense, oracle_rows, _) = run(synthetic_sources, tmp_path / "oracle", mode=mode)
    run_dir = tmp_path / "scaled"
    seen: dict[str, Any] = {}

    def progress(report: dict[str, Any]) -> None:
        step = report["step"]
        if step == 10:
            seen["grow"] = request_scale(str(run_dir), 3, buckets_per_round=8)  # 21 buckets: 3 rounds
        elif step == 15:  # the first round ran at step 10: a second request is refused here ...
            with pytest.raises(ScaleError, match="resharding to 3 shards is in progress"):
                request_scale(str(run_dir), 4)
            # ... and by the driver, when one is written past psrec scale
            (run_dir / REQUEST_FILE).write_text(json.dumps({"id": "second", "shards": 4}))
        elif step == 25:
            (run_dir / REQUEST_FILE).write_text("{not json")
        elif step == 30:
            seen["shrink"] = request_scale(str(run_dir), 1, buckets_per_round=16)  # 42 buckets: 3 rounds
        elif step == 45:
            (run_dir / REQUEST_FILE).write_text(json.dumps({"id": "zero", "shards": 0}))

    summary, (dense, rows, shard_count) = run(synthetic_sources, run_dir, progress, mode=mode)
    # the final model is the undisturbed one
    assert summary["steps"] == oracle_summary["steps"] == 60
    assert shard_count == 1
    for name, value in oracle_dense.items():
        torch.testing.assert_close(dense[name], value, rtol=0, atol=0, msg=name)
    assert_same_tables(rows, oracle_rows)
    assert summary["validation"]["auc"] == oracle_summary["validation"]["auc"]
    # what was done and refused, and why
    handled = {entry["id"]: entry for entry in summary["resharding"]}
    grow, shrink = handled[seen["grow"]["id"]], handled[seen["shrink"]["id"]]
    assert (grow["state"], grow["from_shards"], grow["shards"]) == ("done", 2, 3)
    assert [r["step"] for r in grow["rounds"]] == [10, 15, 20]
    assert sum(r["buckets"] for r in grow["rounds"]) == 21
    assert (shrink["state"], shrink["from_shards"], shrink["shards"]) == ("done", 3, 1)
    assert [r["step"] for r in shrink["rounds"]] == [30, 35, 40]
    assert sum(r["buckets"] for r in shrink["rounds"]) == 42
    assert handled["second"]["state"] == "refused" and "in progress" in handled["second"]["message"]
    assert (
        handled["zero"]["state"] == "refused"
        and "between 1 and the number of virtual buckets (64), got 0" in (handled["zero"]["message"])
    )
    unreadable = [e for e in summary["resharding"] if e.get("id") is None]
    assert len(unreadable) == 1 and "is not JSON" in unreadable[0]["message"]
    status = json.loads((run_dir / STATUS_FILE).read_text())
    assert status["current"] is None and len(status["history"]) == 5
    assert not (run_dir / DRIVER_FILE).exists() and not (run_dir / REQUEST_FILE).exists()
    # each checkpoint says its layout; the first one after a round is full (rounds come right after
    # the checkpoints of steps 10, 20, 30 and 40)
    layouts = {ref.step: (ref.kind, len(read_manifest(ref)["shards"])) for ref in list_checkpoints(run_dir)}
    assert [layouts[step] for step in (10, 20, 30, 40, 50)] == [
        ("delta", 2),
        ("full", 3),
        ("full", 3),
        ("full", 3),
        ("full", 1),
    ]
    # checkpoints before, during and after the moves restore into other shard counts exactly
    for step in (10, 20, 40, 50):
        for shards in (2, 3):
            assert_same_tables(
                restored_rows(synthetic_sources, run_dir, step, shards, mode),
                restored_rows(synthetic_sources, tmp_path / "oracle", step, 2, mode),
            )


def test_scale_requests_that_cannot_be_made_say_why_and_write_nothing(
    synthetic_sources: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ScaleError, match="not a psrec run directory"):
        request_scale(str(tmp_path / "nothing"), 3)
    run_dir = tmp_path / "run"
    config = small_run_config(synthetic_sources, run_dir, **SETTINGS)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    with pytest.raises(ScaleError, match=r"no training is running there .*--set ps.num_shards=3"):
        request_scale(str(run_dir), 3)
    driver = {"pid": 2**22 + 12345, "host": socket.gethostname()}  # above Linux's pid_max: never alive
    (run_dir / DRIVER_FILE).write_text(json.dumps(driver))
    with pytest.raises(ScaleError, match="is not running any more"):
        request_scale(str(run_dir), 3)
    (run_dir / DRIVER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    for shards in (0, 65):
        with pytest.raises(
            ScaleError, match=f"between 1 and the number of virtual buckets \\(64\\), got {shards}"
        ):
            request_scale(str(run_dir), shards)
    with pytest.raises(ScaleError, match="buckets-per-round"):
        request_scale(str(run_dir), 3, buckets_per_round=0)
    changed = config.model_dump(mode="json", by_alias=True)
    changed["ps"]["strategy"] = "collective"
    (run_dir / "config.json").write_text(json.dumps(changed))
    with pytest.raises(ScaleError, match="strategy 'collective'"):
        request_scale(str(run_dir), 3)
    assert not (run_dir / REQUEST_FILE).exists()
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    first = request_scale(str(run_dir), 3)
    with pytest.raises(ScaleError, match=f"request {first['id']} .* waits for the driver"):
        request_scale(str(run_dir), 4)
    assert json.loads((run_dir / REQUEST_FILE).read_text())["shards"] == 3
    # the command prints the reason and exits 2; --wait returns the driver's entry of the request
    assert main(["scale", str(run_dir), "--shards", "5"]) == 2
    assert f"request {first['id']}" in capsys.readouterr().err
    done = {"id": first["id"], "state": "done", "shards": 3}
    (run_dir / STATUS_FILE).write_text(json.dumps({"current": None, "history": [done]}))
    assert wait_for(str(run_dir), first["id"], timeout=5) == done
    with pytest.raises(ScaleError, match="not finished after"):
        wait_for(str(run_dir), "other", timeout=0.3)
