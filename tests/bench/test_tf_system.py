"""The optional TensorFlow/Keras systems of `psrec bench` (fp32 and bf16): skipped with a way out when
absent, their input hand-off, the bf16 one's pairing with the other bf16 systems, and (only where
PSREC_BENCH_TF_PYTHON names a Python with TensorFlow) a tiny run of each.

Run: `python -m pytest tests/bench/test_tf_system.py -q`; with TensorFlow in another environment:
`PSREC_BENCH_TF_PYTHON=/tmp/tfvenv/bin/python python -m pytest tests/bench/test_tf_system.py -q`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.bench import cli as commands
from psrec.bench import tf_system
from psrec.bench.harness import run_bench, summarize
from psrec.bench.systems import SYSTEMS, reference
from psrec.bench.tf_dlrm import split_batches
from psrec.bench.workload import TensorBatch
from tests.bench.test_bench import tiny_workload


@pytest.mark.parametrize("name", ["tensorflow", "tensorflow-bf16"])
def test_tensorflow_is_skipped_with_how_to_get_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(tf_system.PYTHON_VARIABLE, raising=False)
    monkeypatch.setattr(tf_system.importlib.util, "find_spec", lambda name: None)
    (row,) = run_bench(tiny_workload(tmp_path / "cache"), [name], rounds=1, isolate=False)["rows"]
    assert row["status"].startswith("skipped: TensorFlow not found")
    assert tf_system.PYTHON_VARIABLE in row["status"] and "--tf-python" in row["status"]


@pytest.mark.parametrize("name", ["tensorflow", "tensorflow-bf16"])
def test_a_tf_python_that_is_not_there_is_skipped(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tf_system.PYTHON_VARIABLE, str(tmp_path / "no" / "python"))
    (row,) = run_bench(tiny_workload(tmp_path / "cache"), [name], rounds=1, isolate=False)["rows"]
    assert row["status"].startswith("skipped: ") and "is not a file" in row["status"]


@pytest.mark.parametrize(("name", "precision"), [("tensorflow", "fp32"), ("tensorflow-bf16", "bf16")])
def test_the_script_is_asked_for_the_systems_precision(
    name: str, precision: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request handed to tf_dlrm.py names the precision; a failing script becomes the row's error."""
    requests: list[dict[str, Any]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        requests.append(json.loads(Path(command[2]).read_text()))
        return subprocess.CompletedProcess(command, 1, "", "no TensorFlow here")

    monkeypatch.setenv(tf_system.PYTHON_VARIABLE, sys.executable)
    monkeypatch.setattr(tf_system.subprocess, "run", fake_run)
    (row,) = run_bench(tiny_workload(tmp_path / "cache"), [name], rounds=1, isolate=False)["rows"]
    assert [request["precision"] for request in requests] == [precision]
    assert "tensorflow exit 1: no TensorFlow here" in row["status"]


def test_bf16_tensorflow_pairs_with_the_bf16_systems() -> None:
    system = SYSTEMS["tensorflow-bf16"]
    assert (system.precision, system.fp32_twin, system.ceiling) == ("bf16", "tensorflow", "ceiling-bf16")
    assert SYSTEMS["tensorflow"].precision == "fp32"
    for name in ("psrec-bf16", "psrec-bf16-compile", "psrec-bf16-prepared", "pytorch-bf16"):
        assert reference(name, "tensorflow") == "tensorflow-bf16", name
    assert reference("psrec", "tensorflow") == "tensorflow"
    assert reference("tensorflow-bf16", "pytorch") == "pytorch-bf16"
    assert reference("psrec-fp16rows", "tensorflow") is None


def test_x_tf_and_best_peer_divide_by_the_same_precision_within_rounds() -> None:
    rates = [
        # round 0: TensorFlow bf16 is the fastest bf16 peer; round 1: pytorch-bf16 is.
        {"tensorflow": 100.0, "tensorflow-bf16": 160.0, "pytorch-bf16": 150.0, "psrec": 120.0},
        {"tensorflow": 100.0, "tensorflow-bf16": 100.0, "pytorch-bf16": 125.0, "psrec": 150.0},
    ]
    psrec_bf16 = [320.0, 250.0]
    runs: list[dict[str, Any]] = []
    for round_index, (per_system, mine) in enumerate(zip(rates, psrec_bf16, strict=True)):
        for name, rate in [*per_system.items(), ("psrec-bf16", mine)]:
            runs.append({"system": name, "round": round_index, "samples_per_second": rate})
            runs[-1]["samples_per_cpu_second"] = rate / 2
    names = ["tensorflow", "tensorflow-bf16", "pytorch-bf16", "psrec", "psrec-bf16"]
    rows = {row["system"]: row for row in summarize(runs, names)}
    bf16 = rows["psrec-bf16"]
    assert bf16["ratio_to_tensorflow"] == pytest.approx((2.0 + 2.5) / 2)  # by tensorflow-bf16, not fp32
    assert bf16["cpu_ratio_to_tensorflow"] == pytest.approx((2.0 + 2.5) / 2)
    assert bf16["ratio_to_best_peer"] == pytest.approx((2.0 + 2.0) / 2)  # 320/160, then 250/125
    assert bf16["cpu_ratio_to_best_peer"] == pytest.approx(2.0)
    assert rows["psrec"]["ratio_to_tensorflow"] == pytest.approx((1.2 + 1.5) / 2)
    assert rows["tensorflow-bf16"]["ratio_to_fp32"] == pytest.approx((1.6 + 1.0) / 2)  # cross-precision
    assert rows["tensorflow-bf16"]["fraction_of_ceiling"] is None  # no ceiling-bf16 ran
    report = {
        "workload": tiny_workload(Path("unused")).to_dict(),
        "machine": {"cpu": "test cpu", "cores": 2, "load_average": [0.0, 0.0, 0.0]},
        "rounds": 2,
        "rows": list(rows.values()),
    }
    (line,) = [line for line in commands.format_table(report).splitlines() if line.startswith("psrec-bf16 ")]
    assert line.split()[7:9] == ["2.25", "2.00"]  # x TF, x peer


def test_the_script_reads_back_the_batches_it_is_handed(tmp_path: Path) -> None:
    def batch(ids: list[list[int]], lengths: list[list[int]]) -> TensorBatch:
        size = len(lengths[0])
        return TensorBatch(
            dense=torch.arange(size * 13, dtype=torch.float32).reshape(size, 13),
            labels=torch.ones(size),
            ids=[torch.tensor(f, dtype=torch.int64) for f in ids],
            offsets=[torch.zeros(size, dtype=torch.int64) for _ in ids],
            lengths=[torch.tensor(f, dtype=torch.int64) for f in lengths],
        )

    # Two features; bags of 1 and 2 ids and an empty one.
    batches = [batch([[5, 6], [1, 2, 3]], [[1, 1], [2, 1]]), batch([[7], [4]], [[1, 0], [0, 1]])]
    tf_system.write_split(tmp_path / "split.npz", batches)
    with np.load(tmp_path / "split.npz") as arrays:
        read = split_batches(dict(arrays), batch_size=2, num_sparse=2)
    assert len(read) == 2
    assert read[0]["ids"][1].tolist() == [1, 2, 3] and read[0]["bags"][1].tolist() == [0, 0, 1]
    assert read[1]["ids"][0].tolist() == [7] and read[1]["bags"][0].tolist() == [0]
    assert read[1]["ids"][1].tolist() == [4] and read[1]["bags"][1].tolist() == [1]
    np.testing.assert_array_equal(read[1]["dense"], batches[1].dense.numpy())


@pytest.mark.skipif(
    not os.environ.get(tf_system.PYTHON_VARIABLE), reason=f"{tf_system.PYTHON_VARIABLE} not set"
)
def test_tensorflow_systems_train(tmp_path: Path) -> None:
    names = ["pytorch", "pytorch-bf16", "tensorflow", "tensorflow-bf16"]
    report = run_bench(tiny_workload(tmp_path / "cache"), names, rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    for name, precision in (("tensorflow", "fp32"), ("tensorflow-bf16", "bf16")):
        row = rows[name]
        assert row["status"] == "ok", row["status"]
        assert row["samples_per_second"] > 0 and row["peak_rss_bytes"] > 0 and 0.0 <= row["auc"] <= 1.0
        assert row["precision"] == precision and row["ratio_to_pytorch"] is not None
    assert rows["tensorflow-bf16"]["ratio_to_fp32"] is not None
    assert rows["pytorch-bf16"]["ratio_to_tensorflow"] is not None
