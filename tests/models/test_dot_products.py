"""The interaction's numba kernels against the batched matmul and autograd (psrec/models/dot_products.py)."""

from __future__ import annotations

import numba
import pytest
import torch

from psrec.models import dot_products
from psrec.models.layers import DotInteraction


def reference(bottom: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
    """Float64 oracle: all pairwise products by bmm, the strict upper triangle in row-major order."""
    vectors = pooled if bottom is None else torch.cat([bottom.unsqueeze(1), pooled], dim=1)
    count = vectors.shape[1]
    rows, columns = torch.triu_indices(count, count, offset=1)
    upper = torch.bmm(vectors, vectors.transpose(1, 2))[:, rows, columns]
    return upper if bottom is None else torch.cat([bottom, upper], dim=1)


def tolerance(dim: int, scale: float) -> float:
    """fp32 dot products of length `dim` in any order: at most about dim * eps * sum |x_d y_d|; the
    products of two vectors of entries up to `scale` sum to at most dim * scale^2."""
    return 2 * dim * torch.finfo(torch.float32).eps * dim * scale * scale


@pytest.mark.parametrize("has_bottom", [True, False])
@pytest.mark.parametrize(("batch", "features", "dim"), [(200, 26, 64), (3, 1, 16), (130, 5, 7)])
def test_forward_and_backward_match_the_float64_oracle(
    has_bottom: bool, batch: int, features: int, dim: int
) -> None:
    generator = torch.Generator().manual_seed(batch + features + dim)
    pooled = torch.rand(batch, features, dim, generator=generator) * 2 - 1
    bottom = torch.rand(batch, dim, generator=generator) * 2 - 1 if has_bottom else None
    count = features + int(has_bottom)
    grad = (
        torch.rand(batch, (dim if has_bottom else 0) + count * (count - 1) // 2, generator=generator) * 2 - 1
    )

    leaves = [t.clone().requires_grad_() for t in ([pooled] if bottom is None else [pooled, bottom])]
    assert dot_products.uses_kernels(leaves[0], leaves[1] if has_bottom else None)
    out = dot_products.interaction(leaves[1] if has_bottom else None, leaves[0])
    out.backward(grad)

    oracle_leaves = [t.double().requires_grad_() for t in ([pooled] if bottom is None else [pooled, bottom])]
    expected = reference(oracle_leaves[1] if has_bottom else None, oracle_leaves[0])
    expected.backward(grad.double())

    atol = tolerance(dim, 1.0)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected.detach(), rtol=0, atol=atol)
    # a gradient row sums count - 1 terms g * v (|g|, |v| <= 1), each an fp32 product, plus grad's head
    grad_atol = 2 * count * torch.finfo(torch.float32).eps * count
    for leaf, oracle in zip(leaves, oracle_leaves, strict=True):
        assert leaf.grad is not None and oracle.grad is not None
        torch.testing.assert_close(leaf.grad.double(), oracle.grad, rtol=0, atol=grad_atol)


def test_module_takes_the_kernels_only_for_fp32_cpu_outside_autocast() -> None:
    pooled = torch.rand(4, 3, 8)
    assert dot_products.uses_kernels(pooled, torch.rand(4, 8))
    assert not dot_products.uses_kernels(pooled.double(), None)
    assert not dot_products.uses_kernels(pooled, torch.rand(4, 8).bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not dot_products.uses_kernels(pooled, None)


@pytest.mark.parametrize("has_bottom", [True, False])
def test_module_agrees_with_its_pytorch_path(has_bottom: bool) -> None:
    """DotInteraction through the kernels (fp32) against the same module's bmm path (float64)."""
    torch.manual_seed(0)
    module = DotInteraction(6, 16, has_bottom=has_bottom)
    pooled = torch.randn(33, 6, 16)
    bottom = torch.randn(33, 16) if has_bottom else None
    fast = module(bottom, pooled)
    slow = module.double()(None if bottom is None else bottom.double(), pooled.double())
    torch.testing.assert_close(fast.double(), slow, rtol=1e-5, atol=1e-5)


def test_result_does_not_depend_on_the_thread_count() -> None:
    pooled = torch.randn(1000, 26, 64)
    bottom = torch.randn(1000, 64, requires_grad=True)
    threads = numba.get_num_threads()
    outputs = []
    try:
        for count in sorted({1, threads}):
            numba.set_num_threads(count)
            leaf = pooled.clone().requires_grad_()
            out = dot_products.interaction(bottom, leaf)
            out.sum().backward()
            outputs.append((out.detach(), leaf.grad))
    finally:
        numba.set_num_threads(threads)
    for out, grad in outputs[1:]:
        assert torch.equal(out, outputs[0][0]) and torch.equal(grad, outputs[0][1])


def test_empty_batch_single_feature_and_strided_input() -> None:
    empty = dot_products.interaction(torch.zeros(0, 4), torch.zeros(0, 3, 4, requires_grad=True))
    assert empty.shape == (0, 4 + 6)
    lone = dot_products.interaction(None, torch.ones(5, 1, 4))
    assert lone.shape == (5, 0)
    strided = torch.randn(6, 4, 3).transpose(1, 2).requires_grad_()  # (6, 3, 4), not contiguous
    out = dot_products.interaction(None, strided)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(out.double(), reference(None, strided.detach().double()), rtol=0, atol=1e-5)
    assert strided.grad is not None and strided.grad.shape == (6, 3, 4)
