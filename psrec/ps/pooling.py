"""Pooling of single-valued features as one gather over the pulled rows, with a numba backward.

When every pooled feature has exactly one id per sample (the common CTR case), the model input
(B, F, D) is a gather of the fused rows buffer (`psrec.ps.client.LookupPlan.fused_index`, sample
major). PyTorch's backward of `index_select` on the CPU (`index_select_backward`: zeros, then
`index_add_`, which expands the index to the gradient's full shape for a `scatter_add_`) measured
6.4 ms for 106k rows of dim 64 (batch 4096 x 26 features, 1 thread); the scatter-add loop here
does the same sums, in the same order every time (deterministic), in a fraction of that
(`docs/benchmarks.md`), and reads the incoming gradient in whatever strides it has (a slice of
the interaction's concatenation, typically) without a copy.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch


@numba.njit(cache=True, nogil=True)
def _scatter_add_rows(
    out: np.ndarray, index: np.ndarray, grad: np.ndarray, first: int, features: int
) -> None:
    """out[index[b * features + f]] += grad[b, first + f] for every sample b and feature f, in order."""
    batch, dim = grad.shape[0], grad.shape[2]
    for b in range(batch):
        for f in range(features):
            source = grad[b, first + f]
            target = out[index[b * features + f]]
            for d in range(dim):
                target[d] += source[d]


def _enclosing_rows(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(C-contiguous (B, F', D) tensor, first feature) sharing `grad`'s memory when `grad` is a run of
    whole rows of one, e.g. DLRM's pooled part of the interaction's concatenation; else (grad, 0).
    The kernel's inner loop then runs on contiguous rows (1.6x faster than on a strided view)."""
    batch, _, dim = grad.shape
    stride = grad.stride()
    if stride[2] != 1 or stride[1] != dim or stride[0] % dim or batch == 0:
        return grad, 0
    first = (grad.storage_offset() % stride[0]) // dim
    if first + grad.shape[1] > stride[0] // dim:
        return grad, 0
    start = grad.storage_offset() - first * dim
    if (start + batch * stride[0]) * grad.element_size() > grad.untyped_storage().nbytes():
        return grad, 0
    whole = grad.as_strided((batch, stride[0] // dim, dim), (stride[0], dim, 1), start)
    return whole, first


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, features: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index).view(-1, features, rows.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (index,) = ctx.saved_tensors
        if grad.dtype != torch.float32:  # not produced by psrec's fp32 rows; keep PyTorch's path
            grad = grad.float()
        out = torch.zeros(ctx.num_rows, grad.shape[2], dtype=torch.float32)
        whole, first = _enclosing_rows(grad.detach())
        _scatter_add_rows(out.numpy(), index.numpy(), whole.numpy(), first, grad.shape[1])
        return out, None, None


def gather_rows(rows: torch.Tensor, index: np.ndarray, features: int) -> torch.Tensor:
    """(B, features, D) = rows[index].view(B, features, D) for sample-major `index`; differentiable
    in `rows` (float32, 2-D) with a numba scatter-add backward."""
    return _GatherRows.apply(rows, torch.from_numpy(index), features)
