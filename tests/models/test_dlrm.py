import torch
from model_testing import DIM, NUM_DENSE, NUM_SPARSE, assert_gradients_reach, tiny_input

from psrec.models import DLRM


def test_dlrm_forward_backward_with_dense() -> None:
    torch.manual_seed(0)
    model = DLRM(
        NUM_DENSE, NUM_SPARSE, DIM, bottom_hidden_sizes=[6], top_hidden_sizes=[7, 5], batch_norm=True
    )
    inp = tiny_input()
    logits = model(inp)
    assert logits.shape == (4,)
    assert model.interaction.output_dim == DIM + (NUM_SPARSE + 1) * NUM_SPARSE // 2
    loss, scores = model.loss(inp, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert loss.ndim == 0 and scores.shape == (4,) and not scores.requires_grad
    assert ((scores > 0) & (scores < 1)).all()
    assert_gradients_reach(model, loss, [inp.pooled])


def test_dlrm_without_dense_has_no_bottom() -> None:
    model = DLRM(0, NUM_SPARSE, DIM, top_hidden_sizes=[7])
    assert model.bottom is None
    inp = tiny_input(num_dense=0)
    loss, _ = model.loss(inp, torch.ones(4))
    assert_gradients_reach(model, loss, [inp.pooled])
    assert model.predict(inp).shape == (4,)
    assert not DLRM.uses_linear_terms


def test_dlrm_cat_interaction_feeds_the_concatenated_vectors_to_the_top_mlp() -> None:
    torch.manual_seed(0)
    model = DLRM(NUM_DENSE, NUM_SPARSE, DIM, bottom_hidden_sizes=[6], top_hidden_sizes=[7], interaction="cat")
    inp = tiny_input()
    assert model.interaction.output_dim == (NUM_SPARSE + 1) * DIM
    bottom = model.bottom(inp.dense)
    expected = torch.cat([bottom, inp.pooled.flatten(1)], dim=1)
    torch.testing.assert_close(model.interaction(bottom, inp.pooled), expected)
    loss, _ = model.loss(inp, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert_gradients_reach(model, loss, [inp.pooled])
    no_dense = DLRM(0, NUM_SPARSE, DIM, top_hidden_sizes=[7], interaction="cat")
    assert no_dense.interaction.output_dim == NUM_SPARSE * DIM
