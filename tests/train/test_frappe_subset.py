"""End to end on Frappe-shaped libfm data: examples/frappe_deepfm.yaml trains in-process for one epoch.

Two twins with the same field layout (the example's `field_ranges`): the first 20,000 train rows of
the real Frappe set (../shared/data, skipped when absent; copied to a temporary directory, never into
the repository), and a generated libfm file that always runs. Both assert validation and test AUC
well above chance. Small batches and a larger learning rate than the example's make one short epoch
enough; everything else (model, schema, embedding L2, early stopping) is the example's.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from psrec.config import load_config
from psrec.train.loop import train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "frappe_deepfm.yaml"
ROWS = {"train": 20_000, "validation": 5_000, "test": 5_000}


def run_example(paths: dict[str, Path], run_dir: Path) -> dict[str, Any]:
    overrides: dict[str, Any] = {f"data.{split}.paths": [str(path)] for split, path in paths.items()}
    overrides.update(
        {
            "run_dir": str(run_dir),
            "training.epochs": 1,
            "training.batch_size": 256,
            "training.eval_batch_size": 8192,
            "training.log_every_steps": 40,
            "training.dense_optimizer.lr": 0.003,
            "embedding.default.optimizer.lr": 0.01,
            "checkpoint.enabled": False,
        }
    )
    config = load_config(EXAMPLE, overrides=overrides)
    assert config.ps.runtime == "local"
    return train(config)


def field_ranges() -> dict[str, tuple[int, int]]:
    config = load_config(EXAMPLE)
    assert config.data.train is not None and config.data.train.field_ranges is not None
    return dict(config.data.train.field_ranges)


def test_frappe_subset_learns(shared_data: Path, tmp_path: Path) -> None:
    paths = {}
    for split, rows in ROWS.items():
        source = shared_data / "frappe" / f"frappe.{split}.libfm"
        paths[split] = tmp_path / f"{split}.libfm"
        with source.open() as lines:
            paths[split].write_text("".join(itertools.islice(lines, rows)))
    summary = run_example(paths, tmp_path / "run")
    assert summary["rows_consumed"] == ROWS["train"]
    assert summary["validation"]["rows"] == ROWS["validation"] and summary["test"]["rows"] == ROWS["test"]
    assert summary["validation"]["auc"] > 0.85, summary["validation"]
    assert summary["test"]["auc"] > 0.85, summary["test"]


def write_synthetic_frappe(directory: Path, *, seed: int = 0) -> dict[str, Path]:
    """libfm rows with the Frappe field layout; the label follows a logistic model of user, item, and
    context weights plus a user x item affinity (few distinct users/items so 20k rows learn them)."""
    rng = np.random.default_rng(seed)
    ranges = field_ranges()
    used = {name: np.arange(low, min(high, low + 59) + 1) for name, (low, high) in ranges.items()}
    weights = {name: rng.normal(0.0, 1.0, ids.size) for name, ids in used.items()}
    user_factors = rng.normal(0.0, 1.0, (used["user"].size, 4))
    item_factors = rng.normal(0.0, 1.0, (used["item"].size, 4))
    paths = {}
    for split, rows in ROWS.items():
        picks = {name: rng.integers(0, ids.size, rows) for name, ids in used.items()}
        logit = sum(weights[name][pick] for name, pick in picks.items())
        logit = logit + (user_factors[picks["user"]] * item_factors[picks["item"]]).sum(axis=1) - 1.0
        labels = np.where(rng.random(rows) < 1.0 / (1.0 + np.exp(-logit)), 1, -1)
        columns = [[f"{i}:1" for i in used[name][pick]] for name, pick in picks.items()]
        paths[split] = directory / f"{split}.libfm"
        paths[split].write_text(
            "".join(f"{label} {' '.join(tokens)}\n" for label, *tokens in zip(labels, *columns, strict=True))
        )
    return paths


def test_synthetic_frappe_learns(tmp_path: Path) -> None:
    summary = run_example(write_synthetic_frappe(tmp_path), tmp_path / "run")
    assert summary["rows_consumed"] == ROWS["train"]
    assert summary["validation"]["auc"] > 0.8, summary["validation"]
    assert summary["test"]["auc"] > 0.8, summary["test"]
