"""Start-up time in summary.json: from the command's entry and from the `train()` call to the first
step, from wall-clock readings of the run itself (a jumped boot clock changes nothing), bounded by
the run's own time."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from psrec.train.loop import train
from psrec.trainer import builders
from psrec.trainer.startup import paused_gc, startup_report
from tests.conftest import small_run_config


def test_the_start_up_report_counts_from_the_clocks_it_is_given() -> None:
    assert startup_report(1010.0, train_called_at=1003.0, started_at=1000.5) == {
        "seconds_to_first_step": 9.5,
        "seconds_from_train_call": 7.0,
    }
    assert startup_report(1010.0, train_called_at=1003.0) == {  # no program start: from the call
        "seconds_to_first_step": 7.0,
        "seconds_from_train_call": 7.0,
    }
    assert startup_report(None, train_called_at=1003.0, started_at=1000.5) == {
        "seconds_to_first_step": None,
        "seconds_from_train_call": None,
    }


# Runs `psrec train --local` in this process with Linux's boot clock (CLOCK_BOOTTIME) 110 s ahead
# of the wall clock, as on a VM paused or restored while its wall clock was set again; prints the
# wall clock read just before `main`, at the `train()` call and after `main`.
JUMPED_BOOT_CLOCK_RUN = """
import json, sys, time

clock_gettime = time.clock_gettime
time.clock_gettime = lambda clock: clock_gettime(clock) + (110.0 if clock == time.CLOCK_BOOTTIME else 0.0)

import psrec.train.loop
from psrec.cli import main

train, called = psrec.train.loop.train, []

def train_noting_the_call(*args, **kwargs):
    called.append(time.time())
    return train(*args, **kwargs)

psrec.train.loop.train = train_noting_the_call
before = time.time()
code = main(sys.argv[1:])
after = time.time()
print(json.dumps({"before": before, "called": called[0], "after": after}))
sys.exit(code)
"""


@pytest.mark.parametrize("progress", [["--no-progress"], []], ids=["log-lines", "progress-bar"])
def test_a_jumped_boot_clock_does_not_move_the_start_up_figures(
    synthetic_sources: dict[str, Any], tmp_path: Path, progress: list[str]
) -> None:
    """The start-up figures come from wall-clock readings taken in the run itself (the command's
    entry, the `train()` call, the first step's end), never from the boot clock: with it 110 s
    ahead, `psrec train` (with log lines or its progress bar) still reports the time from its entry
    to the first step, within the run's own wall time, and the entry precedes the call by what the
    clocks around them say."""
    config = small_run_config(
        synthetic_sources, tmp_path / "run", **{"training.max_steps": 2, "checkpoint.enabled": False}
    )
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config.model_dump(mode="json", by_alias=True)))
    done = subprocess.run(
        [sys.executable, "-c", JUMPED_BOOT_CLOCK_RUN, "train", str(path), "--local", *progress],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    clocks = json.loads(done.stdout.strip().splitlines()[-1])
    startup = json.loads((tmp_path / "run" / "summary.json").read_text())["startup"]
    assert 0 < startup["seconds_from_train_call"] <= startup["seconds_to_first_step"]
    assert startup["seconds_to_first_step"] <= clocks["after"] - clocks["before"]
    # from the command's entry to the call: main's first line is within milliseconds of `before`
    entry_to_call = startup["seconds_to_first_step"] - startup["seconds_from_train_call"]
    assert entry_to_call == pytest.approx(clocks["called"] - clocks["before"], abs=0.05)


def test_the_summary_says_how_long_the_first_step_took_to_come(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    called = time.time()
    summary = train(small_run_config(synthetic_sources, tmp_path / "run", **{"training.max_steps": 3}))
    returned = time.time()
    startup = summary["startup"]
    assert 0 < startup["seconds_from_train_call"] < returned - called
    # called as a library, without the program's start: counted from the call
    assert startup["seconds_to_first_step"] == startup["seconds_from_train_call"]
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
    dense optimizer is psrec's (`psrec.trainer.dense_optimizer`), and only `training.compile` needs it."""
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
