"""`psrec train` with model hstu: the item table on the PS shards, the sampled softmax over the reader's
negatives, evaluation by sampled and full ranking, exactly as SASRec's path; it learns a next-item rule.

    pytest tests/train/test_hstu_training.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psrec.config import RunConfig, parse_config
from psrec.data.sequences import sasrec_schema
from psrec.train.loop import train

NUM_ITEMS, LENGTH = 60, 12


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 users walking the items in order (item + 1 mod N) from a random start, 6-15 steps, with
    one step in ten jumping to a random item: the next item follows from the last one."""
    path = tmp_path_factory.mktemp("interactions") / "walks.txt"
    rng = np.random.default_rng(0)
    lines = []
    for user in range(1, 301):
        item = int(rng.integers(0, NUM_ITEMS))
        for _ in range(int(rng.integers(6, 16))):
            lines.append(f"{user} {item + 1}\n")
            item = int(rng.integers(0, NUM_ITEMS)) if rng.random() < 0.1 else (item + 1) % NUM_ITEMS
    path.write_text("".join(lines))
    return path


def hstu_config(path: Path, run_dir: Path) -> RunConfig:
    schema = sasrec_schema(LENGTH, num_negatives=16).model_dump()
    schema["sequences"] = [s for s in schema["sequences"] if s["name"] != "neg"]  # the softmax's only
    data = {
        "run_dir": str(run_dir),
        "data": {"schema": schema, "train": {"format": "interactions", "paths": [str(path)]}},
        "model": {
            "name": "hstu",
            "max_length": LENGTH,
            "num_blocks": 2,
            "num_heads": 2,
            "attention_dim": 8,
            "linear_dim": 8,
            "dropout": 0.1,
        },
        "embedding": {
            "default": {
                "dim": 16,
                "optimizer": {"name": "adam", "lr": 0.01, "beta2": 0.98, "lazy": False},
                "initializer": {"kind": "normal", "std": 0.02},
            }
        },
        "training": {
            "batch_size": 32,
            "eval_batch_size": 128,
            "epochs": 3,
            "seed": 1,
            "full_ranking": True,
            "log_every_steps": 2,
            "dense_optimizer": {"name": "adam", "lr": 0.01, "beta2": 0.98},
        },
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 16},
        "checkpoint": {"enabled": False},
    }
    return parse_config(data)


def test_psrec_train_hstu_learns_the_next_item(interactions: Path, tmp_path: Path) -> None:
    config = hstu_config(interactions, tmp_path / "run")
    losses: list[float] = []
    summary = train(config, progress=lambda report: losses.append(report["loss"]))
    assert summary["steps"] == 30  # 300 users, batches of 32, 3 epochs
    assert losses[-1] < 0.25 * losses[0], losses
    test = summary["test"]
    # chance: HR@10 = 10 / 101 among the 100 sampled negatives, about 10 / 50 among the unseen items;
    # the best possible is about 0.9 (one step in ten is random)
    assert test["hr@10"] > 0.7 and test["full_hr@10"] > 0.7, test
    assert test["full_ndcg@10"] > 0.6, test
    assert summary["tables"]["items"]["rows"] == NUM_ITEMS  # every item row lives on the PS shards
