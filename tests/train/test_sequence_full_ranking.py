"""Full-ranking evaluation of SASRec (every item ranked, the user's input items excluded) against NumPy.

The NumPy oracle scores every item by the dot product of the model's last hidden state with the item
rows the parameter server holds, drops the items of the user's input sequence (never the target)
and counts the items scoring at least the target's; HR@K / NDCG@K follow from those ranks. Both
holdouts: SASRec's "last_two" (the whole input excluded) and generative-recommenders' "last" (train
on all but the last item, rank the last, only the input window of `max_length` items excluded).

    pytest tests/train/test_sequence_full_ranking.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.config import parse_config
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.sequences import (
    evaluation_batches,
    full_ranking_batches,
    load_interactions,
    sasrec_schema,
)
from psrec.models import SASRec
from psrec.models.base import ModelInput
from psrec.train.evaluation import evaluation_metrics

NUM_ITEMS, DIM, LENGTH = 30, 8, 6


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """25 users with 3-12 items out of 30 (repeats allowed), user 26 with 2 (no held-out item)."""
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    rng = np.random.default_rng(5)
    lines = [
        f"{user} {item}\n"
        for user in range(1, 26)
        for item in rng.integers(1, NUM_ITEMS + 1, size=rng.integers(3, 13)).tolist()
    ]
    lines += ["26 1\n", "26 2\n"]
    path.write_text("".join(lines))
    return path


def numpy_full_ranks(scores: np.ndarray, targets: np.ndarray, inputs: list[np.ndarray]) -> np.ndarray:
    """scores (B, N) over items 1..N; target items (B,); each user's input items, excluded."""
    ranks = []
    for row, target, seen in zip(scores, targets.tolist(), inputs, strict=True):
        competitors = [
            item for item in range(1, scores.shape[1] + 1) if item != target and item not in set(seen)
        ]
        ranks.append(sum(row[item - 1] >= row[target - 1] for item in competitors))
    return np.array(ranks)


def numpy_hr_ndcg(ranks: np.ndarray, k: int) -> tuple[float, float]:
    hits = [1.0 if r < k else 0.0 for r in ranks.tolist()]
    gains = [1.0 / np.log2(r + 2) if r < k else 0.0 for r in ranks.tolist()]
    return float(np.mean(hits)), float(np.mean(gains))


@pytest.mark.parametrize("split", ["valid", "test"])
def test_full_ranking_batches_hold_the_sampled_protocols_users_and_their_input_items(
    interactions: Path, split: str
) -> None:
    data = load_interactions([interactions])
    sampled = list(evaluation_batches(data, split=split, max_length=LENGTH, batch_size=7, seed=1))
    full = list(full_ranking_batches(data, split=split, max_length=LENGTH, batch_size=7))
    assert [b.batch.batch_size for b in full] == [b.batch_size for b in sampled] == [7, 7, 7, 4]
    for want, got in zip(sampled, full, strict=True):
        np.testing.assert_array_equal(got.batch.row_ids, want.row_ids)
        np.testing.assert_array_equal(got.batch.sequences["seq"].ids, want.sequences["seq"].ids)
        np.testing.assert_array_equal(got.batch.sequences["seq"].mask, want.sequences["seq"].mask)
        np.testing.assert_array_equal(got.targets + 1, want.sequences["candidates"].ids[:, 0])
        np.testing.assert_array_equal(got.batch.sequences["candidates"].ids, [np.arange(1, NUM_ITEMS + 1)])
        for user, seen in zip(got.batch.row_ids.tolist(), got.seen, strict=True):
            index = int(np.searchsorted(data.users, user))
            history = data.history(index)
            inputs = history[:-2] if split == "valid" else history[:-1]  # all of them, not only the last L
            np.testing.assert_array_equal(np.flatnonzero(seen) + 1, np.unique(inputs))


def test_holdout_last_trains_on_all_but_the_last_item_and_ranks_the_last(interactions: Path) -> None:
    data = load_interactions([interactions])
    source = DataSource(format="interactions", paths=[str(interactions)], holdout="last")
    with open_reader(source, sasrec_schema(LENGTH), batch_size=100, seed=4) as reader:
        [batch] = list(reader)
    for row, user in enumerate(batch.row_ids.tolist()):
        history = data.history(int(np.searchsorted(data.users, user)))
        train = history[:-1][-(LENGTH + 1) :]
        sequence = batch.sequences["seq"]
        np.testing.assert_array_equal(sequence.ids[row][sequence.mask[row]], train[:-1])
        np.testing.assert_array_equal(batch.sequences["pos"].ids[row][sequence.mask[row]], train[1:])
    assert batch.row_ids.tolist() == list(range(1, 26))  # user 26: one item before its last, no pair
    for split in ("valid", "test"):  # the same users, inputs and targets: there is no validation item
        sampled = list(
            evaluation_batches(data, split=split, max_length=LENGTH, batch_size=7, seed=1, holdout="last")
        )
        full = list(full_ranking_batches(data, split=split, max_length=LENGTH, batch_size=7, holdout="last"))
        assert [b.batch_size for b in sampled] == [7, 7, 7, 5]  # user 26 is ranked too
        for want, got in zip(sampled, full, strict=True):
            for row, user in enumerate(got.batch.row_ids.tolist()):
                history = data.history(int(np.searchsorted(data.users, user)))
                assert want.sequences["candidates"].ids[row, 0] == history[-1] == got.targets[row] + 1
                np.testing.assert_array_equal(
                    np.flatnonzero(got.seen[row]) + 1, np.unique(history[:-1][-LENGTH:])
                )
    with pytest.raises(ValueError, match="holdout applies to format 'interactions' only"):
        DataSource(format="parquet", paths=["x"], holdout="last")


@pytest.mark.parametrize("holdout", ["last_two", "last"])
def test_full_ranking_run_equals_a_numpy_ranking_and_leaves_the_sampled_metrics(
    interactions: Path, tmp_path: Path, holdout: str
) -> None:
    from psrec.train.runtime import LocalRuntime

    sources: dict[str, Any] = {
        "train": {"format": "interactions", "paths": [str(interactions)], "holdout": holdout}
    }
    config = parse_config(
        {
            "run_dir": str(tmp_path),
            "data": {"schema": sasrec_schema(LENGTH).model_dump(), **sources},
            "model": {"name": "sasrec", "max_length": LENGTH, "num_blocks": 1, "dropout": 0.0},
            "embedding": {"default": {"dim": DIM, "optimizer": {"name": "adam", "lr": 0.01}}},
            "training": {"batch_size": 8, "eval_batch_size": 6, "seed": 3, "full_ranking": True},
            "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 16},
            "checkpoint": {"enabled": False},
        }
    )
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        runtime.start_epoch(0)
        while runtime.train_steps(1)[0].steps:
            pass
        parts = {split: runtime.evaluate(split) for split in ("validation", "test")}
        ids, rows = runtime.table_rows()["items"]
        dense = runtime.dense_states()[0]
    finally:
        runtime.shutdown()
    table = np.zeros((NUM_ITEMS + 1, DIM), np.float32)
    table[ids] = rows  # items never trained keep no row: evaluation reads their initial one
    untrained = np.setdiff1d(np.arange(1, NUM_ITEMS + 1), ids)
    if untrained.size:
        from psrec.embedding.initializers import initial_rows_numpy
        from psrec.trainer import builders

        [spec] = [spec for spec in builders.shard_table_specs(config) if spec.name == "items"]
        table[untrained] = initial_rows_numpy(untrained, DIM, spec.initializer, spec.seed)
    model = SASRec(DIM, max_length=LENGTH, num_blocks=1, dropout=0.0).eval()
    model.load_state_dict(dense)
    data = load_interactions([interactions])
    for split, name in (("valid", "validation"), ("test", "test")):
        users, inputs = [], []
        for index in range(data.users.size):
            history = data.history(index)
            if history.size >= (2 if holdout == "last" else 3):
                users.append(index)
                inputs.append(history[:-2] if split == "valid" and holdout == "last_two" else history[:-1])
        held_out = -2 if split == "valid" and holdout == "last_two" else -1
        targets = np.array([data.history(index)[held_out] for index in users])
        sequences = np.zeros((len(users), LENGTH), np.int64)
        for row, items in enumerate(inputs):
            kept = items[-LENGTH:]
            sequences[row, LENGTH - kept.size :] = kept
        seq = torch.from_numpy(sequences)
        with torch.no_grad():
            hidden = model.run(
                ModelInput(
                    dense=torch.zeros(len(users), 0),
                    pooled=torch.zeros(len(users), 0, DIM),
                    sequences={"seq": torch.from_numpy(table)[seq]},
                    masks={"seq": seq != 0},
                )
            )["hidden"][:, -1].numpy()
        scores = hidden.astype(np.float64) @ table[1:].astype(np.float64).T  # (B, N)
        excluded = [items[-LENGTH:] for items in inputs] if holdout == "last" else inputs
        want = numpy_full_ranks(scores, targets, excluded)
        np.testing.assert_array_equal(parts[name]["full_ranks"], want)
        metrics = evaluation_metrics(parts[name])
        assert metrics["full_mrr"] == pytest.approx(float(np.mean(1 / (want + 1))))
        for k in (1, 5, 10, 50, 200):
            hr, ndcg = numpy_hr_ndcg(want, k)
            assert metrics[f"full_hr@{k}"] == pytest.approx(hr)
            assert metrics[f"full_ndcg@{k}"] == pytest.approx(ndcg)
        sampled = evaluation_metrics({"ranks": parts[name]["ranks"]})
        assert {key: metrics[key] for key in sampled} == sampled
        # Excluding the input items matters here: some outrank the target.
        assert (numpy_full_ranks(scores, targets, [np.zeros(0)] * len(users)) > want).any()


def test_full_ranking_and_its_metrics_are_refused_where_they_do_not_apply() -> None:
    base = {
        "data": {
            "schema": sasrec_schema(LENGTH).model_dump(),
            "train": {"format": "interactions", "paths": ["x"]},
        },
        "model": {"name": "sasrec", "max_length": LENGTH},
    }
    config = parse_config(
        {**base, "training": {"full_ranking": True, "early_stopping": {"metric": "full_ndcg@10"}}}
    )
    assert config.training.full_ranking
    with pytest.raises(ValueError, match="needs training.full_ranking: true"):
        parse_config({**base, "training": {"early_stopping": {"metric": "full_ndcg@10"}}})
    ctr = {
        "data": {
            "schema": {"label": "label", "sparse": [{"name": "item", "table": "items"}]},
            "train": {"format": "parquet", "paths": ["x"]},
        },
        "model": {"name": "deepfm"},
        "training": {"full_ranking": True},
    }
    with pytest.raises(ValueError, match="training.full_ranking ranks items for sasrec and hstu"):
        parse_config(ctr)
    # Evaluation-only: a checkpoint written without it resumes with it.
    assert (
        parse_config(base).fingerprint()
        == parse_config({**base, "training": {"full_ranking": True}}).fingerprint()
    )
