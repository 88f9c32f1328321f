import numpy as np
import pytest
import torch

from psrec.trainer.pooling import gather_rows


@pytest.mark.parametrize("strided", [False, True])
def test_gather_rows_equals_index_select_forward_and_backward(strided: bool) -> None:
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.normal(size=(50, 8)).astype(np.float32))
    index = rng.integers(0, 50, size=7 * 3)  # 7 samples x 3 features, many repeats
    mine = rows.clone().requires_grad_()
    theirs = rows.clone().requires_grad_()
    out = gather_rows(mine, index, 3)
    expected = theirs.index_select(0, torch.from_numpy(index)).view(7, 3, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    weight = torch.from_numpy(rng.normal(size=(7, 4, 8)).astype(np.float32))
    if strided:  # the gradient arrives as a slice of a concatenation, as in DLRM's interaction
        head = torch.zeros(7, 1, 8)
        (torch.cat([head, out], dim=1) * weight).sum().backward()
        (torch.cat([head, expected], dim=1) * weight).sum().backward()
    else:
        (out * weight[:, :3]).sum().backward()
        (expected * weight[:, :3]).sum().backward()
    assert mine.grad is not None and theirs.grad is not None
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    assert mine.grad[np.setdiff1d(np.arange(50), index)].abs().sum() == 0  # untouched rows: zero


def test_gather_rows_backward_of_an_expanded_gradient() -> None:
    rows = torch.ones(4, 2, requires_grad=True)
    gather_rows(rows, np.array([0, 0, 3, 0]), 2).sum().backward()  # grad: stride-0 ones
    assert rows.grad is not None
    assert rows.grad.tolist() == [[3.0, 3.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]


@pytest.mark.parametrize("layout", ["head", "middle", "transposed"])
def test_backward_reads_gradients_in_any_layout(layout: str) -> None:
    """Rows of a wider concatenation (fast contiguous path) or a transposed view (strided path)."""
    rng = np.random.default_rng(1)
    index = rng.integers(0, 9, size=5 * 3)
    rows = torch.from_numpy(rng.normal(size=(9, 4)).astype(np.float32)).requires_grad_()
    pooled = gather_rows(rows, index, 3)  # (5, 3, 4)
    weight = torch.from_numpy(rng.normal(size=(5, 6, 4)).astype(np.float32))
    other = torch.ones(5, 3, 4)
    if layout == "head":
        loss = (torch.cat([pooled, other], dim=1) * weight).sum()
    elif layout == "middle":
        loss = (torch.cat([other[:, :1], pooled, other[:, :2]], dim=1) * weight).sum()
    else:
        loss = (pooled.transpose(0, 1).contiguous() * weight[:, :3].transpose(0, 1)).sum()
    loss.backward()
    first = {"head": 0, "middle": 1, "transposed": 0}[layout]
    upstream = weight[:, first : first + 3].reshape(-1, 4)
    expected = torch.zeros(9, 4).index_add_(0, torch.from_numpy(index), upstream)
    assert rows.grad is not None
    torch.testing.assert_close(rows.grad, expected, rtol=1e-6, atol=1e-6)


def test_bf16_gather_sums_bf16_gradients_in_float32() -> None:
    rng = np.random.default_rng(2)
    index = rng.integers(0, 6, size=8 * 2)
    rows = torch.from_numpy(rng.normal(size=(6, 16)).astype(np.float32)).requires_grad_()
    pooled = gather_rows(rows, index, 2, torch.bfloat16)
    assert pooled.dtype == torch.bfloat16
    torch.testing.assert_close(pooled, rows.detach().to(torch.bfloat16)[index].view(8, 2, 16), rtol=0, atol=0)
    upstream = torch.from_numpy(rng.normal(size=(8, 3, 16)).astype(np.float32)).to(torch.bfloat16)
    (
        torch.cat([torch.zeros(8, 1, 16, dtype=torch.bfloat16), pooled], dim=1).float() * upstream.float()
    ).sum().backward()
    expected = torch.zeros(6, 16).index_add_(
        0, torch.from_numpy(index), upstream[:, 1:].float().reshape(-1, 16)
    )
    assert rows.grad is not None and rows.grad.dtype == torch.float32
    torch.testing.assert_close(rows.grad, expected, rtol=0, atol=1e-6)


def test_bf16_cast_matches_pytorch_bit_for_bit() -> None:
    """Round to nearest even at every tie, NaN, infinities, overflow, subnormals, signed zero."""
    rng = np.random.default_rng(3)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45, 1.0, -1.0], dtype=np.float32
    ).view(np.uint32)
    ties = (rng.integers(0, 1 << 16, 64, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    random_bits = rng.integers(0, 1 << 32, 5 * 64 * 16, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([special, ties, ties | np.uint32(1), ties - np.uint32(1), random_bits])
    bits = np.resize(bits, (len(bits) // 16, 16))
    rows = torch.from_numpy(bits.view(np.float32).copy())
    index = np.arange(rows.shape[0])[::-1].copy()
    out = gather_rows(rows, index, 1, torch.bfloat16)
    expected = rows.to(torch.bfloat16).index_select(0, torch.from_numpy(index)).view(-1, 1, 16)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)  # any NaN stays a NaN (PyTorch's own paths differ in its bits)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_gather_index_out_of_range_is_an_error() -> None:
    rows = torch.ones(4, 2, requires_grad=True)
    for bad in (4, -1):
        with pytest.raises(IndexError, match=f"gather index {bad} at 1"):
            gather_rows(rows, np.array([0, bad]), 1)
