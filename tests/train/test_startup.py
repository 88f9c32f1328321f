"""Start-up time in summary.json: the process's start read from /proc, checked against a clock
read by the parent that started the process; the first step's time bounded by the run's own."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from psrec.train import builders
from psrec.train.loop import train
from psrec.train.startup import paused_gc
from tests.conftest import small_run_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_process_start_time_is_when_the_parent_started_the_process() -> None:
    before = time.time()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from psrec.train.startup import process_start_time; print(process_start_time())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    after = time.time()
    started = float(child.stdout)
    assert before - 0.05 <= started <= after  # clock ticks are 10 ms


def test_the_summary_says_how_long_the_first_step_took_to_come(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    called = time.time()
    summary = train(small_run_config(synthetic_sources, tmp_path / "run", **{"training.max_steps": 3}))
    returned = time.time()
    startup = summary["startup"]
    assert 0 < startup["seconds_from_train_call"] < returned - called
    assert startup["seconds_to_first_step"] > startup["seconds_from_train_call"]  # the process began earlier
    assert gc.isenabled()  # start-up paused the collector only while it imported and built


def test_paused_gc_restores_the_collector_as_it_was() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block turns it back on
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("a failed start-up")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


@pytest.mark.ray
def test_psrec_train_starts_its_cluster_while_it_imports(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """`psrec train` on the embedded cluster (in a fresh process): Ray starts while the driver imports
    its training code (`start_ray_importing`), the run trains, evaluates and checkpoints, the driver
    shuts the cluster it started down, and it never imported torch: only the trainer's process needs
    it (it serialises the checkpoint's dense state), and the driver's import of torch beside Ray's
    start held Ray's start back by about a second."""
    config = small_run_config(
        synthetic_sources,
        tmp_path / "run",
        **{"ps.runtime": "ray", "training.max_steps": 2},
    )
    path = tmp_path / "run.json"  # JSON is YAML
    path.write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    script = (
        "import sys, ray; from psrec.cli import main; code = main(sys.argv[1:]); "
        "assert not ray.is_initialized(), 'the cluster was left running'; "
        "assert 'torch' not in sys.modules, 'the driver imported torch'; sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "train", str(path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["startup"]["seconds_to_first_step"] > 0
    assert summary["validation"]["rows"] > 0 and 0 < summary["validation"]["auc"] < 1
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    from psrec import checkpoint

    latest = checkpoint.list_checkpoints(tmp_path / "run")[-1]
    dense = checkpoint.load_checkpoint(latest).dense
    assert latest.step == 2 and set(dense) == {"model", "optimizer"}
    model = builders.build_model_for(config)
    model.load_state_dict(dense["model"])  # the trainer's dense state, as the driver wrote it


def test_a_local_run_does_not_import_the_compiler(synthetic_sources: dict[str, Any], tmp_path: Path) -> None:
    """`psrec train --local` trains without importing `torch._dynamo` (about 0.6 s of start-up): the
    dense optimizer is psrec's (`psrec.train.dense_optimizer`), and only `training.compile` needs it."""
    config = small_run_config(
        synthetic_sources, tmp_path / "run", **{"training.max_steps": 2, "checkpoint.enabled": False}
    )
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    script = (
        "import sys; from psrec.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch._dynamo' not in sys.modules, 'the run imported torch._dynamo'; sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "train", str(path), "--local", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
