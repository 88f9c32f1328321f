"""Small trained runs for the serving tests: DeepFM on synthetic Criteo-shaped data, SASRec and HSTU
on a synthetic interactions file; each trained once per session in process, checkpoints kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.config import RunConfig, parse_config
from psrec.train.loop import train
from tests.conftest import small_run_config


def ctr_config(sources: dict[str, Any], run_dir: Path, model: dict[str, Any], **overrides: Any) -> RunConfig:
    options: dict[str, Any] = {"model": model, "training.epochs": 1, "checkpoint.every_steps": 40}
    options.update(overrides)
    return small_run_config(sources, run_dir, **options)


@pytest.fixture(scope="session")
def deepfm_run(synthetic_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A DeepFM run (full + delta checkpoints) and its sources."""
    run_dir = tmp_path_factory.mktemp("serve") / "deepfm"
    model = {"name": "deepfm", "hidden_sizes": [16, 8], "batch_norm": True, "dropout": 0.2}
    config = ctr_config(synthetic_sources, run_dir, model)
    train(config)
    return {"config": config, "run_dir": run_dir, "sources": synthetic_sources}


def write_interactions(path: Path, *, users: int, items: int, seed: int) -> None:
    """'user item' lines in time order; each user walks a noisy cycle of items (learnable order)."""
    rng = np.random.default_rng(seed)
    lines = []
    for user in range(1, users + 1):
        start = int(rng.integers(1, items + 1))
        length = int(rng.integers(5, 20))
        for step in range(length):
            item = (start + step * 3 + int(rng.integers(0, 2))) % items + 1
            lines.append(f"{user} {item}")
    path.write_text("\n".join(lines) + "\n")


def sasrec_config(run_dir: Path, data: Path, **overrides: Any) -> RunConfig:
    length = 12
    sequences = [
        {"name": name, "table": "items", "max_length": length, "hashed": False, "namespace": "item"}
        for name in ("seq", "pos", "neg")
    ]
    config = {
        "run_dir": str(run_dir),
        "data": {
            "schema": {"label": "label", "sequences": sequences},
            "train": {"format": "interactions", "paths": [str(data)]},
        },
        "model": {"name": "sasrec", "max_length": length, "num_blocks": 1, "num_heads": 1, "dropout": 0.2},
        "embedding": {"default": {"dim": 8, "optimizer": {"name": "adam", "lr": 0.01}}},
        "training": {
            "batch_size": 32,
            "eval_batch_size": 64,
            "epochs": 4,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
            "log_every_steps": 5,
            "seed": 3,
        },
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 64},
        "checkpoint": {"every_steps": 5},
    }
    return parse_config(config, overrides=overrides)


@pytest.fixture(scope="session")
def sasrec_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("serve-sasrec")
    data = root / "interactions.txt"
    write_interactions(data, users=500, items=120, seed=0)
    config = sasrec_config(root / "run", data)
    train(config)
    return {"config": config, "run_dir": root / "run", "data": data}


def hstu_config(run_dir: Path, data: Path) -> RunConfig:
    """A small HSTU (2 blocks, 2 heads) with the sampled softmax over 16 negatives per user."""
    length = 12
    sequences = [
        {"name": name, "table": "items", "max_length": size, "hashed": False, "namespace": "item"}
        for name, size in (("seq", length), ("pos", length), ("negatives", 16))
    ]
    config = {
        "run_dir": str(run_dir),
        "data": {
            "schema": {"label": "label", "sequences": sequences},
            "train": {"format": "interactions", "paths": [str(data)], "holdout": "last"},
        },
        "model": {"name": "hstu", "max_length": length, "num_heads": 2, "attention_dim": 4, "linear_dim": 4},
        "embedding": {"default": {"dim": 8, "optimizer": {"name": "adam", "lr": 0.01}}},
        "training": {
            "batch_size": 32,
            "eval_batch_size": 64,
            "epochs": 3,
            "dense_optimizer": {"name": "adam", "lr": 0.01},
            "log_every_steps": 5,
            "seed": 3,
        },
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 64},
        "checkpoint": {"every_steps": 5},
    }
    return parse_config(config)


@pytest.fixture(scope="session")
def hstu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("serve-hstu")
    data = root / "interactions.txt"
    write_interactions(data, users=500, items=120, seed=1)
    config = hstu_config(root / "run", data)
    train(config)
    return {"config": config, "run_dir": root / "run", "data": data}


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``exported(run_dir, precision=..., checkpoint=...)``: an export directory, written once per
    session for each (run, checkpoint, precision); tests must not modify it."""
    from psrec.serve.export import export_run

    root = tmp_path_factory.mktemp("exports")
    cache: dict[tuple[str, str, str | None], Path] = {}

    def export(run_dir: Path, *, precision: str = "fp32", checkpoint: str | None = None) -> Path:
        key = (str(run_dir), precision, checkpoint)
        if key not in cache:
            out = root / f"export-{len(cache)}"
            export_run(run_dir, out, precision=precision, checkpoint=checkpoint)
            cache[key] = out
        return cache[key]

    return export
