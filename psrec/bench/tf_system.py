"""The optional TensorFlow/Keras DLRM systems of `psrec bench` ("tensorflow", "tensorflow-bf16"), each run
in its own process.

TensorFlow and torch rarely share an environment, so the model runs under a separate Python:
`PSREC_BENCH_TF_PYTHON` (or `psrec bench --tf-python PATH`, which sets it), else this interpreter
when it imports TensorFlow; without either the system reports ``skipped: <how to get one>``.
Setting one up, outside the repository::

    python -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu
    psrec bench --systems pytorch,tensorflow,psrec --tf-python /tmp/tfvenv/bin/python

This side reads the same batches as the PyTorch systems (psrec's reader, ids as row numbers through
`assign_rows`, so every distinct id has its own row), writes them as `.npz`, and runs
`tf_dlrm.py` (NumPy + TensorFlow only) on them under the workload's settings: DLRM 13-512-256-D /
dot / 512-256-1, Adagrad on the tables, Adam on the MLPs, `workload.threads` threads; fp32, or with
``bf16=True`` ("tensorflow-bf16") under Keras' `mixed_bfloat16` policy (fp32 tables and variables,
bf16 compute, fp32 loss). The AUC is computed here, with psrec's metric, from the scores the script
returns.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from psrec.bench.torch_systems import assign_rows
from psrec.bench.workload import BOTTOM_HIDDEN_SIZES, TOP_HIDDEN_SIZES, TensorBatch, Workload, load_batches

PYTHON_VARIABLE = "PSREC_BENCH_TF_PYTHON"
SCRIPT = Path(__file__).with_name("tf_dlrm.py")


def tensorflow_python() -> tuple[str | None, str]:
    """The Python to run TensorFlow with, or None and why there is none."""
    configured = os.environ.get(PYTHON_VARIABLE)
    if configured:
        if not Path(configured).is_file():
            return None, f"{PYTHON_VARIABLE}={configured} is not a file"
        return configured, ""
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable, ""
    return None, (
        f"TensorFlow not found: set {PYTHON_VARIABLE} (or --tf-python) to a Python with TensorFlow, "
        "e.g. python -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu"
    )


def write_split(path: Path, batches: list[TensorBatch]) -> None:
    """Batches as the arrays `tf_dlrm.split_batches` reads: dense, labels, ids_f and lengths_f."""
    arrays: dict[str, np.ndarray] = {
        "dense": np.concatenate([batch.dense.numpy() for batch in batches]),
        "labels": np.concatenate([batch.labels.numpy() for batch in batches]),
    }
    for feature in range(len(batches[0].ids)):
        arrays[f"ids_{feature}"] = np.concatenate([batch.ids[feature].numpy() for batch in batches])
        arrays[f"lengths_{feature}"] = np.concatenate([batch.lengths[feature].numpy() for batch in batches])
    np.savez(path, **arrays)  # type: ignore[arg-type]


def run_tensorflow(
    workload: Workload, sources: dict[str, Any], *, bf16: bool = False, timeout: float = 1800.0
) -> dict[str, Any]:
    from psrec.trainer.metrics import auc

    python, reason = tensorflow_python()
    if python is None:
        return {"skipped": reason}
    train = load_batches(
        sources["train"], workload, batch_size=workload.batch_size, max_batches=workload.total_steps
    )
    validation = load_batches(sources["validation"], workload, batch_size=16384)
    sizes = assign_rows([train, validation], workload.table_sizes())
    with tempfile.TemporaryDirectory(prefix="psrec-bench-tf-") as tmp:
        root = Path(tmp)
        write_split(root / "train.npz", train)
        write_split(root / "validation.npz", validation)
        request = {
            "train": str(root / "train.npz"),
            "validation": str(root / "validation.npz"),
            "table_sizes": sizes,
            "dim": workload.dim,
            "batch_size": workload.batch_size,
            "warmup_steps": workload.warmup_steps,
            "steps": workload.steps,
            "threads": workload.threads,
            "sparse_lr": workload.sparse_lr,
            "dense_lr": workload.dense_lr,
            "init_scale": workload.init_scale,
            "seed": workload.seed,
            "bottom_hidden_sizes": list(BOTTOM_HIDDEN_SIZES),
            "top_hidden_sizes": list(TOP_HIDDEN_SIZES),
            "precision": "bf16" if bf16 else "fp32",
        }
        (root / "request.json").write_text(json.dumps(request))
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "OMP_NUM_THREADS": str(workload.threads),
            "CUDA_VISIBLE_DEVICES": "",  # the CPU system it is (`result["device"]`), on any machine
        }
        command = [python, str(SCRIPT), str(root / "request.json"), str(root / "result.json")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
        if done.returncode != 0 or not (root / "result.json").exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"tensorflow exit {done.returncode}: {' | '.join(tail)}"[:500]}
        result: dict[str, Any] = json.loads((root / "result.json").read_text())
    scores = np.asarray(result.pop("validation_scores"), dtype=np.float64)
    labels = np.concatenate([batch.labels.numpy() for batch in validation])
    result["auc"] = auc(labels, scores) if scores.size else None
    result["device"] = "cpu"
    return result
