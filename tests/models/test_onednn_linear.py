"""oneDNN's Linear (+ ReLU) against nn.Linear (+ ReLU), the oracle, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psrec.models.layers import MLP
from psrec.models.onednn_linear import linear, uses_onednn


def _tolerance(length: int) -> dict[str, float]:
    # two fp32 sums of `length` products in different orders: each within about length * eps of the
    # exact sum of magnitudes; values and gradients here are O(1) per term
    return {
        "rtol": 4 * length * torch.finfo(torch.float32).eps,
        "atol": 4 * length * torch.finfo(torch.float32).eps,
    }


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_equal_nn_linear(relu: bool, bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, inputs, outputs = 37, 29, 23
    layer = nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(batch, inputs, generator=generator, requires_grad=True)
    assert uses_onednn(x, layer.weight) == torch.backends.mkldnn.is_available()
    weights = torch.randn(batch, outputs, generator=generator)
    out = linear(x, layer.weight, layer.bias, relu=relu)
    (out * weights).sum().backward()
    got = (x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    expected = layer(x)
    expected = torch.relu(expected) if relu else expected
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, **_tolerance(inputs))
    torch.testing.assert_close(got[0], x.grad, **_tolerance(outputs))
    torch.testing.assert_close(got[1], layer.weight.grad, **_tolerance(batch))
    if bias:
        torch.testing.assert_close(got[2], layer.bias.grad, **_tolerance(batch))


def test_an_mlp_equals_plain_pytorch_layers_and_bf16_autocast_keeps_pytorch_path() -> None:
    torch.manual_seed(1)
    mlp = MLP(13, [64, 32], output_dim=1)
    assert [type(layer).__name__ for layer in mlp.layers] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [getattr(layer, "relu", None) for layer in mlp.layers] == [True, None, True, None, False]
    plain = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
    plain.load_state_dict(mlp.layers.state_dict())  # the same state dict as nn.Linear's
    x = torch.randn(50, 13)
    torch.testing.assert_close(mlp(x), plain(x), **_tolerance(64))
    torch.testing.assert_close(mlp.layers(x), plain(x), **_tolerance(64))  # the ReLU again: no change
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(x, mlp.layers[0].weight)
        assert torch.equal(mlp(x), mlp.layers(x))
    assert not uses_onednn(x.double(), mlp.layers[0].weight.double())
