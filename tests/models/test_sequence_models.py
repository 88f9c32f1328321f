"""BST and SASRec: forward/backward, masking, and that composing the stages equals forward."""

import pytest
import torch
from model_testing import assert_gradients_reach

from psrec.models import BehaviorSequenceTransformer, SASRec
from psrec.models.base import ModelInput

B, L, D, F = 3, 5, 8, 4


def left_padded_mask(lengths: list[int], length: int = L) -> torch.Tensor:
    positions = torch.arange(length)
    return positions.unsqueeze(0) >= (length - torch.tensor(lengths)).unsqueeze(1)  # (B, L)


def bst_input(seed: int = 0) -> ModelInput:
    generator = torch.Generator().manual_seed(seed)
    return ModelInput(
        dense=torch.randn(B, 2, generator=generator),
        pooled=torch.randn(B, F, D, generator=generator).requires_grad_(),
        sequences={"history": torch.randn(B, L, D, generator=generator).requires_grad_()},
        masks={"history": left_padded_mask([5, 2, 0])},
    )


def sasrec_input(*, candidates: int | None = None, seed: int = 0) -> ModelInput:
    generator = torch.Generator().manual_seed(seed)
    sequences = {
        name: torch.randn(B, L, D, generator=generator).requires_grad_() for name in ("seq", "pos", "neg")
    }
    if candidates is not None:
        sequences["candidates"] = torch.randn(B, candidates, D, generator=generator)
    return ModelInput(
        dense=torch.zeros(B, 0),
        pooled=torch.zeros(B, 0, D),
        sequences=sequences,
        masks={"seq": left_padded_mask([5, 3, 1])},
    )


def make_bst() -> BehaviorSequenceTransformer:
    return BehaviorSequenceTransformer(
        2, F, D, target_feature_index=1, max_length=L, num_blocks=2, num_heads=2, hidden_sizes=[16, 8]
    )


def test_bst_forward_backward() -> None:
    torch.manual_seed(0)
    model = make_bst()
    inp = bst_input()
    assert model(inp).shape == (B,)
    loss, scores = model.loss(inp, torch.tensor([1.0, 0.0, 1.0]))
    assert scores.shape == (B,) and torch.isfinite(loss)
    assert_gradients_reach(model, loss, [inp.pooled, inp.sequences["history"]])


def test_bst_ignores_padded_history() -> None:
    torch.manual_seed(0)
    model = make_bst().eval()
    inp = bst_input()
    changed = bst_input()
    with torch.no_grad():
        changed.sequences["history"][:, :3] += 100.0  # padding of sample 1 (2 real) and all of sample 2
        before, after = model(inp), model(changed)
    torch.testing.assert_close(before[1:], after[1:])
    assert not torch.allclose(before[0], after[0])


def test_bst_stages_compose_to_forward() -> None:
    torch.manual_seed(0)
    model = make_bst().eval()
    inp = bst_input()
    embedding, blocks, head = model.stages()
    with torch.no_grad():
        state = embedding(inp)
        state = {name: tensor.clone() for name, tensor in state.items()}  # as if moved to another device
        composed = head(blocks(state))["logits"]
        torch.testing.assert_close(composed, model(inp))


def test_bst_rejects_bad_construction_and_lengths() -> None:
    with pytest.raises(ValueError, match="target_feature_index"):
        BehaviorSequenceTransformer(0, F, D, target_feature_index=F)
    with pytest.raises(ValueError, match="length"):
        BehaviorSequenceTransformer(2, F, D, target_feature_index=0, max_length=L + 1)(bst_input())


def test_sasrec_loss_backward_and_scores() -> None:
    torch.manual_seed(0)
    model = SASRec(D, max_length=L + 2, num_blocks=2, num_heads=2)
    inp = sasrec_input()
    loss, scores = model.loss(inp)
    assert loss.ndim == 0 and scores.shape == (B, 2) and not scores.requires_grad
    assert_gradients_reach(model, loss, [inp.sequences[name] for name in ("seq", "pos", "neg")])


def test_sasrec_loss_matches_reference_formula() -> None:
    torch.manual_seed(0)
    model = SASRec(D, max_length=L, dropout=0.0)
    inp = sasrec_input()
    out = model.run(inp)
    real = inp.masks["seq"]
    expected = (
        -torch.log(torch.sigmoid(out["pos_logits"][real])).mean()
        - torch.log(1 - torch.sigmoid(out["neg_logits"][real])).mean()
    )
    torch.testing.assert_close(model.loss(inp)[0], expected)


def test_sasrec_is_causal_and_ignores_padding() -> None:
    torch.manual_seed(0)
    model = SASRec(D, max_length=L).eval()
    inp = sasrec_input()
    changed = sasrec_input()
    with torch.no_grad():
        changed.sequences["seq"][:, -1] += 1.0  # the most recent item
        changed.sequences["seq"][2, :4] += 100.0  # padding of sample 2 (1 real item)
        before, after = model.run(inp)["hidden"], model.run(changed)["hidden"]
    torch.testing.assert_close(before[:2, :-1], after[:2, :-1])  # earlier positions cannot see the future
    assert not torch.allclose(before[:, -1], after[:, -1])
    assert torch.isfinite(after).all()


def test_sasrec_candidates_per_user_and_shared() -> None:
    torch.manual_seed(0)
    model = SASRec(D, max_length=L).eval()
    inp = sasrec_input(candidates=7)
    with torch.no_grad():
        per_user = model(inp)
        last = model.run(inp)["hidden"][:, -1]
        torch.testing.assert_close(per_user, torch.einsum("bd,bcd->bc", last, inp.sequences["candidates"]))
        shared = inp.sequences["candidates"][0]  # (N, D) all items
        inp.sequences["candidates"] = shared
        torch.testing.assert_close(model.predict(inp), last @ shared.T)
    assert per_user.shape == (B, 7)


def test_sasrec_stages_compose_to_forward() -> None:
    torch.manual_seed(0)
    model = SASRec(D, max_length=L).eval()
    inp = sasrec_input(candidates=4)
    embedding, blocks, head = model.stages()
    with torch.no_grad():
        composed = head(blocks(embedding(inp)))
        torch.testing.assert_close(composed["candidate_logits"], model(inp))
        torch.testing.assert_close(composed["pos_logits"], model.run(inp)["pos_logits"])


def test_sasrec_requires_its_inputs() -> None:
    model = SASRec(D, max_length=L)
    with pytest.raises(ValueError, match="candidates"):
        model(sasrec_input())
    with pytest.raises(ValueError, match="up to"):
        SASRec(D, max_length=L - 1)(sasrec_input(candidates=2))
