"""psrec's SASRec against a plain PyTorch SASRec (`psrec.testing.sasrec_reference`), step by step.

The oracle gets psrec's weights (`copy_to_reference`) and, for training, psrec's initial item rows,
batches and negatives; it steps everything with one `torch.optim.Adam(betas=(0.9, 0.98))`, the item
table included (dense). psrec trains the same config through its parameter server (in process, 2
shards, the item table on ``adam`` with ``lazy: false``).

    pytest tests/models/test_sasrec_reference.py
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.config import RunConfig, parse_config
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.sequences import evaluation_batches, load_interactions, sasrec_schema
from psrec.embedding.initializers import initial_rows_numpy
from psrec.models import SASRec
from psrec.models.base import ModelInput
from psrec.models.transformer import TransformerBlock
from psrec.testing.sasrec_reference import (
    ReferenceSASRec,
    reference_init,
    reference_loss,
    reference_optimizer,
    reference_training_rows,
)
from psrec.trainer import builders
from psrec.trainer.metrics import sampled_ranks

NUM_ITEMS, DIM, LENGTH = 40, 8, 8


def copy_to_reference(model: SASRec, reference: ReferenceSASRec) -> None:
    """psrec's dense weights into the oracle (the item table is not part of psrec's model)."""
    with torch.no_grad():
        reference.pos_emb.weight.copy_(model.embedding.positions)
        for index, block in enumerate(model.blocks.blocks):
            assert isinstance(block, TransformerBlock)
            attention = reference.attention_layers[index]
            projections = (block.attention.query, block.attention.key, block.attention.value)
            attention.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            attention.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            attention.out_proj.weight.copy_(block.attention.output.weight)
            attention.out_proj.bias.copy_(block.attention.output.bias)
            for source, target in (
                (block.attention_norm, reference.attention_layernorms[index]),
                (block.ffn_norm, reference.forward_layernorms[index]),
            ):
                target.load_state_dict(source.state_dict())
            forward = reference.forward_layers[index]
            for source, target in (
                (block.ffn.layers[0], forward.conv1),
                (block.ffn.layers[3], forward.conv2),
            ):
                target.weight.copy_(source.weight.unsqueeze(-1))  # (D, D, 1): a kernel-1 convolution
                target.bias.copy_(source.bias)
        reference.last_layernorm.load_state_dict(model.head.norm.state_dict())


def random_sequences(batch: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, LENGTH + 1) left-padded item ids (0 = padding), 2..LENGTH + 1 real ones per row."""
    items = torch.randint(1, NUM_ITEMS + 1, (batch, LENGTH + 1), generator=generator)
    lengths = torch.randint(2, LENGTH + 2, (batch, 1), generator=generator)
    return items * (torch.arange(LENGTH + 1) >= LENGTH + 1 - lengths)


def psrec_input(table: torch.Tensor, sequences: dict[str, torch.Tensor]) -> ModelInput:
    """ids (B, L) per name -> psrec's ModelInput: rows of `table`, padding (id 0) a zero row."""
    batch = next(iter(sequences.values())).shape[0]
    return ModelInput(
        dense=torch.zeros(batch, 0),
        pooled=torch.zeros(batch, 0, DIM),
        sequences={name: table[ids] * (ids != 0).unsqueeze(-1) for name, ids in sequences.items()},
        masks={name: ids != 0 for name, ids in sequences.items() if name != "candidates"},
    )


def test_sasrec_initialises_as_the_reference() -> None:
    torch.manual_seed(0)
    model = SASRec(50, max_length=200, dropout=0.2)
    reference = ReferenceSASRec(3416, 50, max_length=200)
    reference_init(reference, 0)
    block = model.blocks.blocks[0]
    assert isinstance(block, TransformerBlock)
    pairs = [
        (model.embedding.positions, reference.pos_emb.weight),
        (block.attention.query.weight, reference.attention_layers[0].in_proj_weight),
        (block.attention.output.weight, reference.attention_layers[0].out_proj.weight),
        (block.ffn.layers[0].weight, reference.forward_layers[0].conv1.weight),
    ]
    for ours, theirs in pairs:  # the same distributions: stds within 5%
        assert float(ours.detach().std()) == pytest.approx(float(theirs.detach().std()), rel=0.05)
    assert float(block.attention.query.weight.detach().std()) == pytest.approx(math.sqrt(2 / 200), rel=0.05)
    assert float(block.attention.key.bias.detach().abs().max()) == 0.0
    assert block.attention_norm.eps == model.head.norm.eps == reference.last_layernorm.eps == 1e-8


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-mode-without-dropout"])
def test_forward_and_loss_equal_the_reference(training: bool) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = SASRec(DIM, max_length=LENGTH, num_blocks=2, num_heads=2, dropout=0.0).train(training)
    reference = ReferenceSASRec(NUM_ITEMS, DIM, max_length=LENGTH, num_heads=2, dropout=0.0)
    reference.mask_padded_keys = True
    copy_to_reference(model, reference)
    reference.train(training)
    table = reference.item_emb.weight
    items = random_sequences(6, generator)
    seq, pos = items[:, :-1], items[:, 1:]
    neg = torch.randint(1, NUM_ITEMS + 1, pos.shape, generator=generator) * (pos != 0)
    candidates = torch.randint(1, NUM_ITEMS + 1, (6, 11), generator=generator)
    inp = psrec_input(table, {"seq": seq, "pos": pos, "neg": neg, "candidates": candidates})
    inp.masks["pos"] = pos != 0
    out = model.run(inp)
    pos_logits, neg_logits = reference(seq, pos, neg)
    real = pos != 0
    torch.testing.assert_close(out["pos_logits"][real], pos_logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["neg_logits"][real], neg_logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(inp), reference.predict(seq, candidates), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.loss(inp)[0], reference_loss(pos_logits, neg_logits, pos))


def test_unmasked_padded_keys_change_the_outputs() -> None:
    """The reference lets queries attend padded keys (their value: the value bias); psrec does not.
    Both give the same numbers on Beauty (docs/results.md); this pins which one psrec is."""
    torch.manual_seed(0)
    model = SASRec(DIM, max_length=LENGTH, dropout=0.0).eval()
    reference = ReferenceSASRec(NUM_ITEMS, DIM, max_length=LENGTH, dropout=0.0).eval()
    copy_to_reference(model, reference)
    with torch.no_grad():
        for attention in reference.attention_layers:
            attention.in_proj_bias.normal_()  # nonzero value bias: padded keys carry a value
    items = random_sequences(4, torch.Generator().manual_seed(2))
    candidates = items[:, -3:].clamp(min=1)
    unmasked = reference.predict(items[:, :-1], candidates)
    reference.mask_padded_keys = True
    masked = reference.predict(items[:, :-1], candidates)
    assert not torch.allclose(masked, unmasked, atol=1e-3)


# -- training through the parameter server ---------------------------------------------------------
BATCH, EPOCHS = 20, 3


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`user item` lines: users 1-20 with 20-25 items out of 40 (the first batch of every epoch touches
    every item), users 21-40 with 4 (the second leaves items untouched: dense and lazy Adam differ)."""
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    rng = np.random.default_rng(0)
    lines = [
        f"{user} {item}\n"
        for user in range(1, 41)
        for item in rng.integers(1, NUM_ITEMS + 1, size=rng.integers(20, 26) if user <= 20 else 4).tolist()
    ]
    path.write_text("".join(lines))
    return {"train": {"format": "interactions", "paths": [str(path)]}}


def run_config(sources: dict[str, Any], run_dir: Path) -> RunConfig:
    """The reference's settings at toy size (no dropout: its random draws cannot be matched)."""
    adam = {"name": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.98}
    data = {
        "run_dir": str(run_dir),
        "data": {"schema": sasrec_schema(LENGTH).model_dump(), **sources},
        "model": {"name": "sasrec", "max_length": LENGTH, "num_blocks": 2, "num_heads": 1, "dropout": 0.0},
        "embedding": {
            "default": {
                "dim": DIM,
                "optimizer": {**adam, "lazy": False},
                "initializer": {"kind": "normal", "std": 0.1},
            }
        },
        "training": {"batch_size": BATCH, "dense_optimizer": adam, "seed": 3, "shuffle_buffer": 0},
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 16},
        "checkpoint": {"enabled": False},
    }
    return parse_config(data)


def epoch_batches(config: RunConfig, sources: dict[str, Any], epoch: int) -> list[Any]:
    """The batches the trainer reads in `epoch` (the reader opened as `TrainerWorker.start_epoch` does)."""
    reader = open_reader(
        DataSource.model_validate(sources["train"]),
        config.feature_schema(),
        batch_size=config.training.batch_size,
        shuffle_buffer=config.training.shuffle_buffer,
        seed=config.training.seed * 1000 + epoch,
    )
    try:
        return list(reader)
    finally:
        reader.close()


def test_training_through_the_ps_equals_the_reference(interactions: dict[str, Any], tmp_path: Path) -> None:
    from psrec.train.runtime import LocalRuntime

    config = run_config(interactions, tmp_path)
    runtime = LocalRuntime(config, base_dir=".", data_sources=interactions)
    try:
        initial = runtime.dense_states()[0]
        losses, inserted_after_first_step = [], None
        for epoch in range(EPOCHS):
            runtime.start_epoch(epoch)
            while True:
                [result] = runtime.train_steps(1)
                if result.steps == 0:
                    break
                losses.append(result.loss_sum / result.samples)
                if inserted_after_first_step is None:
                    inserted_after_first_step = runtime.table_rows()["items"][0]
        ids, rows = runtime.table_rows()["items"]
        dense = runtime.dense_states()[0]
        ranks = runtime.evaluate("validation")["ranks"]
    finally:
        runtime.shutdown()
    # Every item's row exists from the first step on, so per-row Adam steps are torch's global ones.
    np.testing.assert_array_equal(inserted_after_first_step, np.arange(1, NUM_ITEMS + 1))
    second_batch = epoch_batches(config, interactions, 0)[1]
    touched = np.unique(
        np.concatenate([second_batch.sequences[n].ids.ravel() for n in ("seq", "pos", "neg")])
    )
    assert np.setdiff1d(np.arange(1, NUM_ITEMS + 1), touched).size >= 3  # rows dense Adam moves, lazy not
    np.testing.assert_array_equal(ids, np.arange(1, NUM_ITEMS + 1))

    model = SASRec(DIM, max_length=LENGTH, num_blocks=2, num_heads=1, dropout=0.0)
    model.load_state_dict(initial)
    reference = ReferenceSASRec(NUM_ITEMS, DIM, max_length=LENGTH, dropout=0.0, mask_padded_keys=True)
    copy_to_reference(model, reference)
    [spec] = [spec for spec in builders.shard_table_specs(config) if spec.name == "items"]
    with torch.no_grad():
        reference.item_emb.weight[1:] = torch.from_numpy(
            initial_rows_numpy(np.arange(1, NUM_ITEMS + 1), DIM, spec.initializer, spec.seed)
        )
    optimizer = reference_optimizer(reference, lr=0.01)
    expected = []
    for epoch in range(EPOCHS):
        for batch in epoch_batches(config, interactions, epoch):
            seq, pos, neg = (torch.from_numpy(batch.sequences[name].ids) for name in ("seq", "pos", "neg"))
            loss = reference_loss(*reference(seq, pos, neg), pos)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            expected.append(float(loss.detach()))
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(rows, reference.item_emb.weight.detach()[1:].numpy(), rtol=1e-3, atol=1e-4)
    model.load_state_dict(dense)
    trained = ReferenceSASRec(NUM_ITEMS, DIM, max_length=LENGTH, dropout=0.0, mask_padded_keys=True)
    copy_to_reference(model, trained)
    want = reference.state_dict()
    key_bias = torch.arange(3 * DIM) // DIM == 1  # zero true gradient: Adam steps float noise
    for name, value in trained.state_dict().items():
        if name == "item_emb.weight":
            continue
        expected_value = want[name]
        if name.endswith("in_proj_bias"):
            value, expected_value = value[~key_bias], expected_value[~key_bias]
        torch.testing.assert_close(value, expected_value, rtol=1e-3, atol=1e-4, msg=name)

    # Evaluation feeds the training sequence (last LENGTH items) and the 101 candidates, target first.
    data = load_interactions([interactions["train"]["paths"][0]])
    reference.eval()
    with torch.no_grad():
        want_ranks = np.concatenate(
            [
                sampled_ranks(
                    reference.predict(
                        torch.from_numpy(batch.sequences["seq"].ids),
                        torch.from_numpy(batch.sequences["candidates"].ids),
                    )
                )
                for batch in evaluation_batches(
                    data, split="valid", max_length=LENGTH, batch_size=16, seed=config.training.seed
                )
            ]
        )
    np.testing.assert_array_equal(ranks, want_ranks)


def test_each_epoch_draws_fresh_negatives_and_a_reopened_epoch_the_same(
    interactions: dict[str, Any], tmp_path: Path
) -> None:
    config = run_config(interactions, tmp_path)

    def negatives(epoch: int) -> dict[int, np.ndarray]:
        out = {}
        for batch in epoch_batches(config, interactions, epoch):
            neg = batch.sequences["neg"]
            for user, ids, mask in zip(batch.row_ids.tolist(), neg.ids, neg.mask, strict=True):
                out[user] = ids[mask]
        return out

    first, again, second = negatives(0), negatives(0), negatives(1)
    assert set(first) == set(second) == set(range(1, 41))
    assert all(np.array_equal(first[user], again[user]) for user in first)
    changed = np.mean([np.mean(first[user] != second[user]) for user in first])
    assert changed > 0.9  # fresh draws over 40 items minus each user's own


def test_reference_rows_follow_the_reference_sampler() -> None:
    train = [np.array([5, 6, 7, 8]), np.arange(1, 30)]
    seq, pos, neg = reference_training_rows(train, np.array([0, 1]), 40, 6, np.random.default_rng(0))
    np.testing.assert_array_equal(seq[0], [0, 0, 0, 5, 6, 7])
    np.testing.assert_array_equal(pos[0], [0, 0, 0, 6, 7, 8])
    np.testing.assert_array_equal(seq[1], [23, 24, 25, 26, 27, 28])
    np.testing.assert_array_equal(pos[1], [24, 25, 26, 27, 28, 29])
    assert (neg[0, :3] == 0).all() and not np.isin(neg[0, 3:], train[0]).any()
    assert not np.isin(neg[1], train[1]).any()
