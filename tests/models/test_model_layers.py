import itertools

import pytest
import torch
from torch import nn

from psrec.models.layers import MLP, CrossNetwork, DotInteraction, FactorizationMachine, make_activation
from psrec.models.onednn_linear import Linear


def test_mlp_layer_order_and_output() -> None:
    mlp = MLP(6, [5, 4], output_dim=1, activation="relu", batch_norm=True, dropout=0.2)
    kinds = [type(layer) for layer in mlp.layers]
    assert kinds == [Linear, nn.BatchNorm1d, nn.ReLU, nn.Dropout] * 2 + [Linear]
    assert all(
        isinstance(layer, nn.Linear) and not layer.relu for layer in mlp.layers if type(layer) is Linear
    )
    assert mlp(torch.randn(3, 6)).shape == (3, 1)
    assert mlp.output_dim == 1
    assert MLP(6, [5]).output_dim == 5


def test_unknown_activation_is_rejected() -> None:
    with pytest.raises(ValueError, match="allowed"):
        make_activation("swishy")


def test_cross_network_matches_formula() -> None:
    torch.manual_seed(0)
    cross = CrossNetwork(4, 2)
    x0 = torch.randn(3, 4)
    x = x0
    for layer in cross.weights:
        x = x0 * (x @ layer.weight.T + layer.bias) + x
    torch.testing.assert_close(cross(x0), x)


def test_low_rank_cross_network_matches_formula() -> None:
    torch.manual_seed(0)
    cross = CrossNetwork(6, 3, low_rank=2)
    x0 = torch.randn(5, 6)
    x = x0
    for layer in cross.weights:
        v, u = layer[0].weight.T, layer[1].weight.T  # (6, 2), (2, 6)
        x = x0 * ((x @ v) @ u + layer[1].bias) + x
    torch.testing.assert_close(cross(x0), x)
    assert sum(p.numel() for p in cross.parameters()) == 3 * (6 * 2 + 2 * 6 + 6)


@pytest.mark.parametrize("with_bottom", [True, False])
def test_dot_interaction_matches_loop(with_bottom: bool) -> None:
    torch.manual_seed(0)
    pooled = torch.randn(2, 3, 4)
    bottom = torch.randn(2, 4) if with_bottom else None
    layer = DotInteraction(3, 4, has_bottom=with_bottom)
    out = layer(bottom, pooled)
    vectors = [bottom] if with_bottom else []
    vectors += [pooled[:, f] for f in range(3)]
    pairs = [(vectors[i] * vectors[j]).sum(-1) for i, j in itertools.combinations(range(len(vectors)), 2)]
    expected = torch.stack(pairs, dim=1)
    if with_bottom:
        expected = torch.cat([bottom, expected], dim=1)
    torch.testing.assert_close(out, expected)
    assert out.shape[1] == layer.output_dim


def test_dot_interaction_rejects_missing_bottom() -> None:
    with pytest.raises(ValueError, match="has_bottom"):
        DotInteraction(3, 4, has_bottom=True)(None, torch.randn(2, 3, 4))


def test_factorization_machine_matches_pairwise_sum() -> None:
    torch.manual_seed(0)
    embeddings = torch.randn(3, 4, 5)
    expected = sum(
        (embeddings[:, i] * embeddings[:, j]).sum(-1) for i, j in itertools.combinations(range(4), 2)
    )
    torch.testing.assert_close(FactorizationMachine()(embeddings), expected)


def test_upper_triangle_products_backward_matches_autograd() -> None:
    import torch

    from psrec.models.layers import UpperTriangleProducts

    torch.manual_seed(0)
    vectors = torch.randn(5, 7, 3, dtype=torch.float64, requires_grad=True)
    rows, columns = torch.triu_indices(7, 7, offset=1)
    index = rows * 7 + columns
    weights = torch.randn(5, index.numel(), dtype=torch.float64)
    (UpperTriangleProducts.apply(vectors, index) * weights).sum().backward()
    fast = vectors.grad.clone()
    vectors.grad = None
    reference = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, index)
    (reference * weights).sum().backward()
    torch.testing.assert_close(fast, vectors.grad)
    torch.autograd.gradcheck(
        lambda v: UpperTriangleProducts.apply(v, index), (vectors.detach().requires_grad_(),)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):  # runs under autocast, gradients reach fp32 leaves
        out = UpperTriangleProducts.apply(vectors.float().detach().requires_grad_(), index)
        out.float().sum().backward()
