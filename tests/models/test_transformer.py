"""The attention paths of `psrec.models.transformer` against PyTorch's unfused attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from psrec.models.transformer import (
    Dropout,
    MultiHeadAttention,
    attention_allowed,
    attention_bias,
    attention_with_dropout,
    dropout_keep,
)

B, H, L, D = 4, 2, 7, 8


def left_padded(lengths: list[int]) -> torch.Tensor:
    return torch.arange(L).unsqueeze(0) >= (L - torch.tensor(lengths)).unsqueeze(1)  # (B, L)


def unfused(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """PyTorch's math (unfused) attention with the boolean mask: the oracle."""
    with sdpa_kernel(SDPBackend.MATH):
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))


def heads(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D // H, generator=generator) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
def test_the_additive_mask_gives_the_unfused_result(causal: bool) -> None:
    mask = left_padded([7, 3, 1, 5])
    bias = attention_bias(mask, causal=causal)
    allowed = attention_allowed(mask, causal=causal)
    assert bias.shape == (B, 1, L, L) and bias.dtype == torch.float32
    assert torch.equal(bias[:, 0] == 0, allowed) and torch.isneginf(bias[:, 0][~allowed]).all()
    q, k, v = heads(0)
    expected = unfused(q, k, v, allowed)
    torch.testing.assert_close(functional.scaled_dot_product_attention(q, k, v, attn_mask=bias), expected)
    torch.testing.assert_close(attention_with_dropout(q, k, v, bias, 0.0), expected)


def test_attention_module_in_eval_and_without_dropout_equals_the_unfused_path() -> None:
    torch.manual_seed(0)
    mask = left_padded([7, 3, 1, 5])
    x = torch.randn(B, L, D)
    for attention in (MultiHeadAttention(D, H, dropout=0.5).eval(), MultiHeadAttention(D, H).train()):
        q, k, v = (
            attention._split_heads(layer(x)) for layer in (attention.query, attention.key, attention.value)
        )
        expected = attention.output(
            unfused(q, k, v, attention_allowed(mask, causal=True)).transpose(1, 2).reshape(B, L, D)
        )
        torch.testing.assert_close(attention(x, x, attention_bias(mask, causal=True)), expected)


def test_attention_with_dropout_is_the_unfused_formula_with_its_mask() -> None:
    q, k, v = heads(1)
    bias = attention_bias(left_padded([7, 3, 1, 5]), causal=True)
    torch.manual_seed(5)
    out = attention_with_dropout(q, k, v, bias, 0.3)
    torch.manual_seed(5)
    weights = torch.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias, dim=-1)
    keep = dropout_keep(weights, 0.3)
    torch.testing.assert_close(out, (weights * keep / 0.7) @ v)


def test_attention_dropout_keeps_the_expectation() -> None:
    torch.manual_seed(0)
    q, k, v = heads(2)
    bias = attention_bias(left_padded([7, 6, 5, 7]), causal=False)
    mean = torch.stack([attention_with_dropout(q, k, v, bias, 0.5) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, attention_with_dropout(q, k, v, bias, 0.0), atol=0.05, rtol=0)


def test_the_training_path_is_taken_on_cpu_with_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import psrec.models.transformer as transformer

    def spy(*args):
        calls.append(args[-1])
        return attention_with_dropout(*args)

    monkeypatch.setattr(transformer, "attention_with_dropout", spy)
    attention = MultiHeadAttention(D, H, dropout=0.2)
    x, bias = torch.randn(B, L, D), attention_bias(left_padded([7, 3, 1, 5]), causal=True)
    attention.train()(x, x, bias)
    attention.eval()(x, x, bias)
    assert calls == [0.2]


def test_dropout_module_keeps_one_minus_p_and_scales_the_rest() -> None:
    torch.manual_seed(0)
    dropout = Dropout(0.3)
    x = torch.ones(200_000, requires_grad=True)
    y = dropout(x)
    kept = y != 0
    assert float(kept.float().mean()) == pytest.approx(0.7, abs=0.005)
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.7))
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, kept.float() / 0.7)
    assert dropout.eval()(x) is x and Dropout(0.0)(x) is x
