"""The pooled-negatives kernel against PyTorch's gather-and-multiply (the oracle)."""

from __future__ import annotations

import pytest
import torch

from psrec.models.pooled_negatives import LOWEST, pooled_negatives_logits


def _oracle(queries, pool, picks, real, targets, pool_ids):  # type: ignore[no-untyped-def]
    logits = torch.einsum("rd,rnd->rn", queries.float(), pool.float()[picks])
    logits = logits.masked_fill(pool_ids[picks] == targets.unsqueeze(-1), LOWEST)
    return torch.where(real.unsqueeze(-1), logits, torch.zeros_like(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_and_gradients_equal_the_gather_oracle(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, pool_rows, count, dim = 50, 24, 9, 13
    queries = torch.randn(rows, dim, generator=generator).to(dtype).requires_grad_()
    pool_ids = torch.randint(0, 6, (pool_rows,), generator=generator)  # few items: hits are common
    items = torch.randn(6, dim, generator=generator)
    pool = items[pool_ids].to(dtype).requires_grad_()  # an item's rows are equal, as looked up
    picks = torch.randint(0, pool_rows, (rows, count), generator=generator)
    real = torch.rand(rows, generator=generator) < 0.7
    targets = torch.randint(0, 6, (rows,), generator=generator)
    logits = pooled_negatives_logits(queries, pool, picks, real=real, targets=targets, pool_ids=pool_ids)
    assert logits.dtype == dtype and logits.shape == (rows, count)
    oracle_queries = queries.detach().float().requires_grad_()
    oracle_pool = pool.detach().float().requires_grad_()
    expected = _oracle(oracle_queries, oracle_pool, picks, real, targets, pool_ids)
    hits = (pool_ids[picks] == targets.unsqueeze(-1)) & real.unsqueeze(-1)
    assert hits.any() and (logits[hits] == torch.finfo(dtype).min).all()
    torch.testing.assert_close(logits[~hits].float(), expected[~hits].to(dtype).float(), rtol=1e-5, atol=1e-5)
    weights = torch.randn(rows, count, generator=generator)
    (logits.float() * weights).sum().backward()
    (expected * weights).sum().backward()
    assert oracle_queries.grad is not None and oracle_pool.grad is not None
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(queries.grad.float(), oracle_queries.grad, **tolerance)  # type: ignore[union-attr]
    # rows of one item are scored as one: the gradient summed per item is the oracle's
    per_item = torch.zeros(6, dim).index_add_(0, pool_ids, pool.grad.float())  # type: ignore[union-attr]
    oracle_per_item = torch.zeros(6, dim).index_add_(0, pool_ids, oracle_pool.grad)
    torch.testing.assert_close(per_item, oracle_per_item, **tolerance)
    assert torch.equal(queries.grad[~real], torch.zeros_like(queries.grad[~real]))  # type: ignore[index]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="picks"):
        pooled_negatives_logits(
            torch.zeros(3, 4),
            torch.zeros(5, 4),
            torch.zeros(2, 6, dtype=torch.int64),
            real=torch.ones(3, dtype=torch.bool),
            targets=torch.zeros(3, dtype=torch.int64),
            pool_ids=torch.zeros(5, dtype=torch.int64),
        )


def test_without_item_numbers_nothing_is_masked_and_every_row_gets_its_own_gradient() -> None:
    generator = torch.Generator().manual_seed(1)
    rows, pool_rows, count, dim = 30, 12, 7, 5
    queries = torch.randn(rows, dim, generator=generator, requires_grad=True)
    pool = torch.randn(pool_rows, dim, generator=generator, requires_grad=True)
    picks = torch.randint(0, pool_rows, (rows, count), generator=generator)
    real = torch.rand(rows, generator=generator) < 0.8
    logits = pooled_negatives_logits(queries, pool, picks, real=real)
    oracle_queries = queries.detach().clone().requires_grad_()
    oracle_pool = pool.detach().clone().requires_grad_()
    never = torch.full((rows,), -1)
    expected = _oracle(
        oracle_queries, oracle_pool, picks, real, never, torch.zeros(pool_rows, dtype=torch.int64)
    )
    torch.testing.assert_close(logits, expected)
    weights = torch.randn(rows, count, generator=generator)
    (logits * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(queries.grad, oracle_queries.grad)
    torch.testing.assert_close(pool.grad, oracle_pool.grad)
    with pytest.raises(ValueError, match="both"):
        pooled_negatives_logits(queries, pool, picks, real=real, targets=never)
