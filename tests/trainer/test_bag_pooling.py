"""The fused bag pooling (psrec.trainer.bag_pooling) against nn.EmbeddingBag, forward and gradients."""

import numba
import numpy as np
import pytest
import torch
from torch import nn

from psrec.allocator import ReusableBuffers
from psrec.trainer.bag_pooling import pool_bags, transpose_bags


def _bags(
    rng: np.random.Generator, batch: int, features: int, num_rows: int, max_length: int
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Random bags (variable lengths, empty ones included) of `features` features laid out one
    feature after the other, as the lookup plan does: (index, offsets (F, B + 1)) and per feature
    the (ids, bag starts) an EmbeddingBag takes."""
    index_parts, offsets, ids, starts = [], np.zeros((features, batch + 1), np.int64), [], []
    position = 0
    for f in range(features):
        lengths = rng.integers(0, max_length + 1, size=batch)
        lengths[: batch // 4] = 0 if f % 2 else lengths[: batch // 4]  # runs of empty bags
        feature_ids = rng.integers(0, num_rows, size=int(lengths.sum()))  # repeats within and across bags
        index_parts.append(feature_ids)
        local = np.concatenate([[0], np.cumsum(lengths)])
        offsets[f] = position + local
        position += int(lengths.sum())
        ids.append(feature_ids)
        starts.append(local[:-1])
    return np.concatenate(index_parts), offsets, ids, starts


def _oracle(
    weight: torch.Tensor, ids: list[np.ndarray], starts: list[np.ndarray], mode: str
) -> tuple[torch.Tensor, nn.EmbeddingBag]:
    bag = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode=mode)
    pooled = [bag(torch.from_numpy(i), torch.from_numpy(s)) for i, s in zip(ids, starts, strict=True)]
    return torch.stack(pooled, dim=1), bag  # (B, F, D)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dim", [64, 8])
def test_float32_pooling_equals_embedding_bag(mode: str, threads: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    batch, features, num_rows = 33, 4, 40
    index, offsets, ids, starts = _bags(rng, batch, features, num_rows, max_length=9)
    weight = torch.from_numpy(rng.normal(size=(num_rows, dim)).astype(np.float32))
    rows = weight.clone().requires_grad_()
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    try:
        out = pool_bags(rows, index, offsets, mode=mode)
        expected, bag = _oracle(weight, ids, starts, mode)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        upstream = torch.from_numpy(rng.normal(size=(batch, features, dim)).astype(np.float32))
        (out * upstream).sum().backward()
        (expected * upstream).sum().backward()
    finally:
        numba.set_num_threads(previous)
    assert rows.grad is not None and bag.weight.grad is not None
    torch.testing.assert_close(rows.grad, bag.weight.grad, rtol=1e-5, atol=1e-5)
    assert (out[: batch // 4, 1] == 0).all()  # feature 1's empty bags pool to zero


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bfloat16_output_is_the_float32_sum_rounded_once(mode: str) -> None:
    rng = np.random.default_rng(1)
    batch, features, num_rows, dim = 17, 3, 25, 32
    index, offsets, ids, starts = _bags(rng, batch, features, num_rows, max_length=12)
    weight = torch.from_numpy(rng.normal(size=(num_rows, dim)).astype(np.float32))
    rows = weight.clone().requires_grad_()
    out = pool_bags(rows, index, offsets, mode=mode, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected, bag = _oracle(weight, ids, starts, mode)
    # float32 sums in another order may round to the neighbouring bfloat16: one bf16 ulp at most
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
    assert (out.float() == expected.to(torch.bfloat16).float()).float().mean() > 0.95
    upstream = torch.from_numpy(rng.normal(size=(batch, features + 1, dim)).astype(np.float32))
    upstream = upstream.to(torch.bfloat16)
    head = torch.zeros(batch, 1, dim, dtype=torch.bfloat16)
    # the bf16 gradient arrives as a slice of the interaction's concatenation, as in DLRM
    (torch.cat([head, out], dim=1).float() * upstream.float()).sum().backward()
    (expected * upstream[:, 1:].float()).sum().backward()
    assert rows.grad is not None and rows.grad.dtype == torch.float32 and bag.weight.grad is not None
    torch.testing.assert_close(rows.grad, bag.weight.grad, rtol=1e-5, atol=1e-5)


def test_gradient_in_a_transposed_layout_and_untouched_rows() -> None:
    rng = np.random.default_rng(2)
    batch, features, num_rows, dim = 9, 2, 30, 16
    index, offsets, ids, starts = _bags(rng, batch, features, num_rows, max_length=4)
    weight = torch.from_numpy(rng.normal(size=(num_rows, dim)).astype(np.float32))
    rows = weight.clone().requires_grad_()
    out = pool_bags(rows, index, offsets)
    expected, bag = _oracle(weight, ids, starts, "sum")
    upstream = torch.from_numpy(rng.normal(size=(features, batch, dim)).astype(np.float32))
    (out.transpose(0, 1).contiguous() * upstream).sum().backward()
    (expected.transpose(0, 1) * upstream).sum().backward()
    assert rows.grad is not None and bag.weight.grad is not None
    torch.testing.assert_close(rows.grad, bag.weight.grad, rtol=1e-5, atol=1e-5)
    untouched = np.setdiff1d(np.arange(num_rows), index)
    assert untouched.size and rows.grad[untouched].abs().sum() == 0


def test_single_id_bags_equal_a_gather() -> None:
    rng = np.random.default_rng(3)
    index = rng.integers(0, 10, size=2 * 6)
    offsets = np.stack([np.arange(7), 6 + np.arange(7)])  # 2 features x 6 samples, one id each
    rows = torch.from_numpy(rng.normal(size=(10, 8)).astype(np.float32))
    out = pool_bags(rows, index, offsets)
    expected = rows[torch.from_numpy(index)].view(2, 6, 8).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_bad_input_is_refused_with_its_reason() -> None:
    rows = torch.zeros(4, 16)
    offsets = np.array([[0, 1, 2]])
    with pytest.raises(IndexError, match="sample 1 .* 4 rows"):
        pool_bags(rows, np.array([0, 4]), offsets)
    with pytest.raises(ValueError, match="mode"):
        pool_bags(rows, np.array([0, 1]), offsets, mode="max")
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, 2\]"):
        pool_bags(rows, np.array([0, 1]), np.array([[0, 1, 3]]))
    with pytest.raises(ValueError, match="float32"):
        pool_bags(rows.double(), np.array([0, 1]), offsets)


def test_a_precomputed_transpose_gives_the_same_gradients() -> None:
    rng = np.random.default_rng(4)
    index, offsets, _, _ = _bags(rng, 20, 3, 15, max_length=7)
    rows = torch.from_numpy(rng.normal(size=(15, 16)).astype(np.float32))
    upstream = torch.from_numpy(rng.normal(size=(20, 3, 16)).astype(np.float32))
    grads = []
    for transposed in (None, transpose_bags(index, offsets, 15)):
        leaf = rows.clone().requires_grad_()
        (pool_bags(leaf, index, offsets, mode="mean", transposed=transposed) * upstream).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    row_starts, owners = transpose_bags(index, offsets, 15)
    assert row_starts[-1] == index.size and np.array_equal(
        np.diff(row_starts), np.bincount(index, minlength=15)
    )
    with pytest.raises(ValueError, match="transposed is for 15 rows"):
        pool_bags(torch.zeros(9, 16), index % 9, offsets, transposed=(row_starts, owners))


def test_a_live_gradient_is_never_overwritten_by_the_next_backward() -> None:
    """The backward's gradient arrays are reused (psrec.allocator.ReusableBuffers) only once released:
    gradients of steps still held keep their values through later backwards (oracle: nn.EmbeddingBag)."""
    rng = np.random.default_rng(5)
    num_rows, dim = 4096, 64  # 1 MiB of gradient: above the pool's threshold
    held, expected = [], []
    buffers = ReusableBuffers()
    for step in range(4):
        index, offsets, ids, starts = _bags(rng, 64, 3, num_rows, max_length=9)
        weight = torch.from_numpy(rng.normal(size=(num_rows, dim)).astype(np.float32))
        upstream = torch.from_numpy(rng.normal(size=(64, 3, dim)).astype(np.float32))
        leaf = weight.clone().requires_grad_()
        (pool_bags(leaf, index, offsets, buffers=buffers) * upstream).sum().backward()
        pooled, bag = _oracle(weight, ids, starts, "sum")
        (pooled * upstream).sum().backward()
        if step % 2 == 0:
            held.append(leaf.grad)  # kept: its array must not be handed out again
            expected.append(bag.weight.grad.clone())
    for grad, oracle in zip(held, expected, strict=True):
        torch.testing.assert_close(grad, oracle, rtol=1e-5, atol=1e-5)
    assert buffers.reused >= 1  # the released gradients' arrays were used again


def test_float32_sums_run_in_id_order_whatever_the_bag_length() -> None:
    """Each bag's sum, and each row's gradient, is the sequential float32 sum in id order (a plain
    NumPy loop as the oracle), bit for bit, for lengths around the kernels' four-a-pass blocks; an
    index out of range anywhere in a bag (inside such a block too) is refused."""
    rng = np.random.default_rng(6)
    num_rows, dim = 50, 24
    lengths = np.array([0, 1, 3, 4, 5, 7, 8, 9, 13, 50])
    offsets = np.concatenate([[0], np.cumsum(lengths)])[None, :]
    index = rng.integers(0, num_rows, size=int(lengths.sum()))
    rows = rng.normal(size=(num_rows, dim)).astype(np.float32) * np.float32(1e3)
    out = pool_bags(torch.from_numpy(rows), index, offsets).numpy()
    for b in range(lengths.size):
        expected = np.zeros(dim, np.float32)
        for i in index[offsets[0, b] : offsets[0, b + 1]]:
            expected = expected + rows[i]
        np.testing.assert_array_equal(out[b, 0], expected)
    upstream = rng.normal(size=(lengths.size, 1, dim)).astype(np.float32)
    leaf = torch.from_numpy(rows).requires_grad_()
    (pool_bags(leaf, index, offsets) * torch.from_numpy(upstream)).sum().backward()
    expected_grad = np.zeros_like(rows)  # each row's gradients summed in id order
    for b in range(lengths.size):
        for i in index[offsets[0, b] : offsets[0, b + 1]]:
            expected_grad[i] = expected_grad[i] + upstream[b, 0]
    np.testing.assert_array_equal(leaf.grad.numpy(), expected_grad)
    for position in (offsets[0, -2] + 2, offsets[0, -2] + 49):  # in a block of four, in the tail
        bad = index.copy()
        bad[position] = num_rows
        with pytest.raises(IndexError, match=f"sample {lengths.size - 1} "):
            pool_bags(torch.from_numpy(rows), bad, offsets)
