"""The optional TensorFlow/Keras system of `psrec bench`: skipped with a way out when absent, its input
hand-off, and (only where PSREC_BENCH_TF_PYTHON names a Python with TensorFlow) a tiny run.

Run: `python -m pytest tests/bench/test_tf_system.py -q`; with TensorFlow in another environment:
`PSREC_BENCH_TF_PYTHON=/tmp/tfvenv/bin/python python -m pytest tests/bench/test_tf_system.py -q`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from psrec.bench import tf_system
from psrec.bench.harness import run_bench
from psrec.bench.tf_dlrm import split_batches
from psrec.bench.workload import TensorBatch, Workload


def tiny_workload(cache: Path) -> Workload:
    return Workload(
        dim=16,
        batch_size=256,
        train_rows=2048,
        validation_rows=512,
        cardinality_scale=0.001,
        warmup_steps=1,
        steps=2,
        threads=1,
        cache_dir=str(cache),
    )


def test_tensorflow_is_skipped_with_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tf_system.PYTHON_VARIABLE, raising=False)
    monkeypatch.setattr(tf_system.importlib.util, "find_spec", lambda name: None)
    (row,) = run_bench(tiny_workload(tmp_path / "cache"), ["tensorflow"], rounds=1, isolate=False)["rows"]
    assert row["status"].startswith("skipped: TensorFlow not found")
    assert tf_system.PYTHON_VARIABLE in row["status"] and "--tf-python" in row["status"]


def test_a_tf_python_that_is_not_there_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tf_system.PYTHON_VARIABLE, str(tmp_path / "no" / "python"))
    (row,) = run_bench(tiny_workload(tmp_path / "cache"), ["tensorflow"], rounds=1, isolate=False)["rows"]
    assert row["status"].startswith("skipped: ") and "is not a file" in row["status"]


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
def test_tensorflow_system_trains(tmp_path: Path) -> None:
    report = run_bench(tiny_workload(tmp_path / "cache"), ["pytorch", "tensorflow"], rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    row = rows["tensorflow"]
    assert row["status"] == "ok", row["status"]
    assert row["samples_per_second"] > 0 and row["peak_rss_bytes"] > 0 and 0.0 <= row["auc"] <= 1.0
    assert row["precision"] == "fp32" and row["ratio_to_pytorch"] is not None
