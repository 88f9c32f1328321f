import numpy as np
import pytest
import torch

from psrec.ps.pooling import gather_rows


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
