"""SASRec's sampled-softmax objective against plain PyTorch: the loss formula, the model's loss with the
oracle's features (`psrec.testing.sasrec_reference`), and training through the parameter server step
by step.

The oracle computes the cross-entropy of the next item among itself and the user's N negatives with
``torch.nn.functional.cross_entropy`` on the reference model's features; psrec trains the same config
(``model.loss: sampled_softmax``, a "negatives" sequence in the schema) through its PS in process.

    pytest tests/models/test_sasrec_sampled_softmax.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as functional
from test_sasrec_reference import DIM, LENGTH, NUM_ITEMS, copy_to_reference, epoch_batches

from psrec.config import RunConfig, parse_config
from psrec.data.sequences import sasrec_schema
from psrec.embedding.initializers import initial_rows_numpy
from psrec.models import SASRec
from psrec.models.base import ModelInput
from psrec.models.sasrec import sampled_softmax_loss
from psrec.testing.sasrec_reference import ReferenceSASRec, reference_optimizer
from psrec.trainer import builders

NEGATIVES = 6


def reference_softmax_loss(
    reference: ReferenceSASRec, seq: torch.Tensor, pos: torch.Tensor, negatives: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy (torch's) of pos among [pos, the user's negatives] at every real position."""
    feats = reference.log2feats(seq)  # (B, L, D)
    positive = (feats * reference.item_emb(pos)).sum(-1, keepdim=True)  # (B, L, 1)
    negative = torch.einsum("bld,bnd->bln", feats, reference.item_emb(negatives))  # (B, L, N)
    logits = torch.cat([positive, negative], dim=-1)[pos != 0]  # (R, 1 + N)
    return functional.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def test_sampled_softmax_loss_is_the_cross_entropy_of_the_target_among_its_negatives() -> None:
    generator = torch.Generator().manual_seed(0)
    positive, negatives = torch.randn(7, generator=generator), torch.randn(7, 5, generator=generator)
    logits = torch.cat([positive[:, None], negatives], dim=1)
    expected = functional.cross_entropy(logits, torch.zeros(7, dtype=torch.long))
    torch.testing.assert_close(sampled_softmax_loss(positive, negatives), expected)
    # A larger target logit lowers it; one more negative cannot.
    assert sampled_softmax_loss(positive + 1, negatives) < expected
    more = torch.cat([negatives, torch.randn(7, 1, generator=generator)], dim=1)
    assert sampled_softmax_loss(positive, more) > expected


def test_sasrec_sampled_softmax_loss_equals_the_reference() -> None:
    torch.manual_seed(0)
    model = SASRec(DIM, max_length=LENGTH, num_blocks=2, dropout=0.0, loss="sampled_softmax")
    reference = ReferenceSASRec(NUM_ITEMS, DIM, max_length=LENGTH, dropout=0.0, mask_padded_keys=True)
    copy_to_reference(model, reference)
    generator = torch.Generator().manual_seed(1)
    items = torch.randint(1, NUM_ITEMS + 1, (4, LENGTH + 1), generator=generator)
    items = items * (torch.arange(LENGTH + 1) >= torch.tensor([[0], [3], [5], [7]]))  # left padding
    seq, pos = items[:, :-1], items[:, 1:]
    negatives = torch.randint(1, NUM_ITEMS + 1, (4, NEGATIVES), generator=generator)
    table = reference.item_emb.weight.detach()
    inp = ModelInput(
        dense=torch.zeros(4, 0),
        pooled=torch.zeros(4, 0, DIM),
        sequences={
            "seq": table[seq] * (seq != 0).unsqueeze(-1),
            "pos": table[pos] * (pos != 0).unsqueeze(-1),
            "negatives": table[negatives],
        },
        masks={"seq": seq != 0, "pos": pos != 0},
    )
    loss, scores = model.loss(inp)
    torch.testing.assert_close(
        loss, reference_softmax_loss(reference, seq, pos, negatives), rtol=1e-5, atol=1e-6
    )
    assert scores.shape == (4, 2)
    with pytest.raises(ValueError, match=r'\["negatives"\]'):
        model.loss(
            ModelInput(
                inp.dense,
                inp.pooled,
                None,
                {"seq": inp.sequences["seq"], "pos": inp.sequences["pos"]},
                inp.masks,
            )
        )
    with pytest.raises(ValueError, match="loss must be"):
        SASRec(DIM, loss="softmax")  # type: ignore[arg-type]


# -- training through the parameter server ---------------------------------------------------------
BATCH, EPOCHS = 20, 2


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`user item` lines: 40 users with 4-25 items out of 40."""
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    rng = np.random.default_rng(0)
    lines = [
        f"{user} {item}\n"
        for user in range(1, 41)
        for item in rng.integers(1, NUM_ITEMS + 1, size=rng.integers(20, 26) if user <= 20 else 4).tolist()
    ]
    path.write_text("".join(lines))
    return {"train": {"format": "interactions", "paths": [str(path)]}}


def softmax_config(sources: dict[str, Any], run_dir: Path) -> RunConfig:
    adam = {"name": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.98}
    model = {
        "name": "sasrec",
        "max_length": LENGTH,
        "num_blocks": 2,
        "dropout": 0.0,
        "loss": "sampled_softmax",
    }
    return parse_config(
        {
            "run_dir": str(run_dir),
            "data": {"schema": sasrec_schema(LENGTH, num_negatives=NEGATIVES).model_dump(), **sources},
            "model": model,
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
    )


def test_sampled_softmax_training_through_the_ps_equals_the_reference(
    interactions: dict[str, Any], tmp_path: Path
) -> None:
    from psrec.train.runtime import LocalRuntime

    config = softmax_config(interactions, tmp_path)
    runtime = LocalRuntime(config, base_dir=".", data_sources=interactions)
    try:
        initial = runtime.dense_states()[0]
        losses = []
        for epoch in range(EPOCHS):
            runtime.start_epoch(epoch)
            while True:
                [result] = runtime.train_steps(1)
                if result.steps == 0:
                    break
                losses.append(result.loss_sum / result.samples)
        ids, rows = runtime.table_rows()["items"]
    finally:
        runtime.shutdown()
    np.testing.assert_array_equal(ids, np.arange(1, NUM_ITEMS + 1))

    model = SASRec(DIM, max_length=LENGTH, num_blocks=2, dropout=0.0, loss="sampled_softmax")
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
            negatives = batch.sequences["negatives"]
            assert negatives.ids.shape == (batch.batch_size, NEGATIVES) and negatives.mask.all()
            seq, pos = (torch.from_numpy(batch.sequences[name].ids) for name in ("seq", "pos"))
            loss = reference_softmax_loss(reference, seq, pos, torch.from_numpy(negatives.ids))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            expected.append(float(loss.detach()))
    assert len(losses) == len(expected) == EPOCHS * 2
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(rows, reference.item_emb.weight.detach()[1:].numpy(), rtol=1e-3, atol=1e-4)


def _pool_rows(logits: torch.Tensor, hidden: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """(B, L, N) the pool row each logit is the position's score against (float32 arithmetic; the
    random float64 rows' scores are far apart, so exactly one row matches)."""
    every = torch.einsum("bld,md->blm", hidden.detach(), pool.detach())  # (B, L, M)
    close = torch.isclose(logits.detach().unsqueeze(-1), every.unsqueeze(-2), rtol=0, atol=4e-6)
    assert (close.sum(-1) == 1).all(), "a logit is not exactly one pool row's score"
    return close.long().argmax(-1)


def test_negatives_per_position_picks_each_position_own_draws_from_the_batch_pool() -> None:
    """Oracle: the (B, L, B * N) scores of every position against every draw of the batch (einsum).

    Each position's N logits are its row against N rows of the batch's B * N draws; a position's
    picks come from several users' draws; over many positions the picks cover the pool uniformly;
    padded positions score 0; gradients reach the hidden states and the draws as the oracle's gather
    would send them; a seed repeats the picks.
    """
    from psrec.models.sasrec import negatives_logits

    batch, length, count, dim = 6, 40, 16, 8
    hidden = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    negatives = torch.randn(batch, count, dim, dtype=torch.float64, requires_grad=True)
    real = torch.arange(length).unsqueeze(0) >= torch.tensor([[0], [3], [10], [0], [39], [20]])  # (B, L)
    torch.manual_seed(3)
    logits = negatives_logits(hidden, negatives, "position", real=real)
    assert logits.shape == (batch, length, count)
    assert torch.equal(logits[~real], torch.zeros(int((~real).sum()), count, dtype=logits.dtype))
    pool = negatives.reshape(batch * count, dim)
    rows = _pool_rows(logits[real].unsqueeze(0), hidden[real].unsqueeze(0), pool)[0]  # (R, N)
    assert all(len(set((row // count).tolist())) > 1 for row in rows)  # several users' draws
    counts = torch.bincount(rows.flatten(), minlength=batch * count).double()
    expected = rows.numel() / (batch * count)
    assert float(((counts - expected) ** 2 / expected).sum()) < 2 * batch * count  # chi-square, df 95
    weights = torch.randn_like(logits)
    (logits * weights).sum().backward()
    picked = torch.einsum("rd,rnd->rn", hidden[real], pool[rows])
    hidden_grad, negatives_grad = torch.autograd.grad((picked * weights[real]).sum(), (hidden, negatives))
    torch.testing.assert_close(hidden.grad, hidden_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(negatives.grad, negatives_grad, rtol=1e-5, atol=1e-5)
    torch.manual_seed(3)
    torch.testing.assert_close(negatives_logits(hidden, negatives, "position", real=real), logits)
    torch.testing.assert_close(
        negatives_logits(hidden, negatives, "user"), torch.einsum("bld,bnd->bln", hidden, negatives)
    )


@pytest.mark.parametrize("per", ["user", "position"])
def test_a_draw_that_is_the_position_own_next_item_is_masked(per: str) -> None:
    """Oracle: per row, the cross-entropy over the positive and only the draws that are other items
    (the reference's accidental-hit mask), and the unmasked logits of the same seed."""
    from psrec.models.sasrec import negatives_logits

    batch, length, count, dim = 5, 7, 6, 4
    hidden = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    pos_ids = torch.randint(0, 8, (batch, length))  # few items: hits are common
    negatives_ids = torch.randint(0, 8, (batch, count))
    items = torch.randn(8, dim, dtype=torch.float64)
    negatives = items[negatives_ids]  # an item's rows are equal, as looked up
    torch.manual_seed(5)
    plain = negatives_logits(hidden, negatives, per)  # type: ignore[arg-type]
    torch.manual_seed(5)
    masked = negatives_logits(hidden, negatives, per, (pos_ids, negatives_ids))  # type: ignore[arg-type]
    lowest = torch.finfo(masked.dtype).min
    picked = _pool_rows(plain, hidden, items)  # (B, L, N) the item each logit scores
    if per == "user":
        assert all(set(picked[b].flatten().tolist()) <= set(negatives_ids[b].tolist()) for b in range(batch))
    hits = picked == pos_ids.unsqueeze(-1)  # (B, L, N)
    assert hits.any()
    assert (masked[hits] == lowest).all()
    assert torch.equal(masked[~hits], plain[~hits])
    positive = torch.randn(batch, length, dtype=torch.float64)
    loss = sampled_softmax_loss(positive.flatten(), masked.reshape(batch * length, count))
    oracle = torch.stack(
        [
            torch.logsumexp(torch.cat([positive.flatten()[r : r + 1], row[row != lowest]]), 0)
            - positive.flatten()[r]
            for r, row in enumerate(masked.detach().reshape(batch * length, count))
        ]
    ).mean()
    torch.testing.assert_close(loss, oracle)
    loss.backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_negatives_per_is_checked_and_reaches_both_heads() -> None:
    from psrec.models import HSTU

    with pytest.raises(ValueError, match="negatives_per"):
        SASRec(DIM, negatives_per="item")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negatives_per"):
        HSTU(DIM, negatives_per="batch")  # type: ignore[arg-type]
    assert SASRec(DIM, loss="sampled_softmax", negatives_per="position").head.negatives_per == "position"
    assert HSTU(DIM, negatives_per="position").head.negatives_per == "position"


def test_cosine_similarity_is_the_normalised_block_output_over_the_temperature() -> None:
    """Oracle: torch's F.normalize and cross_entropy on the blocks' output (no final layer norm)."""
    torch.manual_seed(0)
    model = SASRec(
        DIM, max_length=LENGTH, dropout=0.0, loss="sampled_softmax", similarity="cosine", temperature=0.05
    )
    assert model.head.norm is None and not list(model.head.parameters())
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(NUM_ITEMS + 1, DIM, generator=generator)
    items = torch.randint(1, NUM_ITEMS + 1, (3, LENGTH + 1), generator=generator)
    items = items * (torch.arange(LENGTH + 1) >= torch.tensor([[0], [2], [6]]))
    seq, pos = items[:, :-1], items[:, 1:]
    negatives = torch.randint(1, NUM_ITEMS + 1, (3, NEGATIVES), generator=generator)
    inp = ModelInput(
        dense=torch.zeros(3, 0),
        pooled=torch.zeros(3, 0, DIM),
        sequences={"seq": table[seq], "pos": table[pos], "negatives": table[negatives], "candidates": table},
        masks={"seq": seq != 0, "pos": pos != 0},
    )
    hidden = functional.normalize(model.blocks(model.embedding(inp))["hidden"], dim=-1, eps=1e-6)
    positive = (hidden * functional.normalize(table[pos], dim=-1)).sum(-1, keepdim=True) / 0.05
    negative = hidden @ functional.normalize(table[negatives], dim=-1).transpose(1, 2) / 0.05
    logits = torch.cat([positive, negative], dim=-1)[pos != 0]
    expected = functional.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))
    loss, _ = model.loss(inp)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    ranked = model(inp)  # (B, items): the last position against every row of the table
    torch.testing.assert_close(
        ranked, hidden[:, -1] @ functional.normalize(table, dim=-1).T / 0.05, rtol=1e-5, atol=1e-4
    )
    with pytest.raises(ValueError, match="similarity"):
        SASRec(DIM, similarity="l2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        SASRec(DIM, similarity="cosine", temperature=0.0)
