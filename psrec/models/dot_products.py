"""DLRM's pairwise dot products on CPU in fp32: numba kernels for the interaction's forward and backward.

The dot interaction takes N vectors of width D per sample (the bottom MLP's output, when there is
one, and the F pooled embeddings) and outputs every pair's dot product, the upper triangle of
V V^T (N (N - 1) / 2 values, pairs (i, j) with i < j in row-major order), after the bottom vector:

    out[b] = [bottom[b], V[b, i] . V[b, j] for i < j]          V[b] = [bottom[b]; pooled[b]]  (N, D)

and its backward, with g[b, (i, j)] the gradient of the pair (i, j):

    dV[b, i] = sum over j != i of g[b, (i, j)] V[b, j],   d bottom[b] = grad[b, :D] + dV[b, 0].

PyTorch's path (`layers.UpperTriangleProducts`) computes all N^2 products with a batched matmul and
gathers the triangle; its backward scatters the gradient into an (N, N) matrix per sample and
multiplies again. Batched matmuls of 27 x 64 matrices run far from the GEMM peak: for the bench
DLRM's interaction (batch 4096, N = 27, D = 64, one thread on the AMD EPYC VM) forward and backward
took 36.6 ms there. These kernels compute only the triangle, read each sample's vectors once from
cache, and write the output (bottom vector included) and the gradients in place, without the
(B, N, D) concatenation.

The kernels run for fp32 CPU tensors outside autocast, `torch.compile` and `torch.export`; the
PyTorch path everywhere else (`uses_kernels`). Sums are float32, vectorised over D in an order of
LLVM's choosing (fastmath reassociation): results agree with the matmul's to fp32 rounding, not bit
for bit, and do not depend on the thread count (each sample is summed by one thread). Test oracle:
the batched matmul and autograd (tests/models/test_dot_products.py).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

from psrec.threads import PARALLEL_LAUNCH

_CHUNK = 64  # samples per parallel task: one (N, D) scratch per task


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _load(bottom: np.ndarray, pooled: np.ndarray, b: int, vectors: np.ndarray) -> None:
    """vectors[:] = [bottom[b]; pooled[b]] (no bottom row when `bottom` has no columns)."""
    first = 1 if bottom.shape[1] > 0 else 0
    if first:
        vectors[0, :] = bottom[b]
    vectors[first:, :] = pooled[b]


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _forward(bottom: np.ndarray, pooled: np.ndarray, out: np.ndarray) -> None:
    """out[b] = [bottom[b], upper triangle of V V^T]; bottom (B, D) or (B, 0), pooled (B, F, D)."""
    batch, features, dim = pooled.shape
    head = bottom.shape[1]
    count = features + (1 if head > 0 else 0)
    for chunk in numba.prange((batch + _CHUNK - 1) // _CHUNK):
        vectors = np.empty((count, dim), dtype=np.float32)
        for b in range(chunk * _CHUNK, min(batch, (chunk + 1) * _CHUNK)):
            _load(bottom, pooled, b, vectors)
            row = out[b]
            row[:head] = bottom[b]
            p = head
            for i in range(count):
                vi = vectors[i]
                for j in range(i + 1, count):
                    vj = vectors[j]
                    total = np.float32(0.0)
                    for d in range(dim):
                        total += vi[d] * vj[d]
                    row[p] = total
                    p += 1


@numba.njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _backward(
    grad: np.ndarray, bottom: np.ndarray, pooled: np.ndarray, grad_bottom: np.ndarray, grad_pooled: np.ndarray
) -> None:
    """grad (B, head + P) -> grad_bottom (B, head) and grad_pooled (B, F, D) (module docstring). Each
    vector's gradient is summed on its own (every pair is visited from both ends), so the sum over D
    vectorises into one accumulator."""
    batch, features, dim = pooled.shape
    head = bottom.shape[1]
    first = 1 if head > 0 else 0
    count = features + first
    for chunk in numba.prange((batch + _CHUNK - 1) // _CHUNK):
        vectors = np.empty((count, dim), dtype=np.float32)
        total = np.empty(dim, dtype=np.float32)
        for b in range(chunk * _CHUNK, min(batch, (chunk + 1) * _CHUNK)):
            _load(bottom, pooled, b, vectors)
            g = grad[b]
            for i in range(count):
                if i == 0 and first:
                    total[:] = g[:head]
                else:
                    total[:] = 0.0
                for j in range(count):
                    if j == i:
                        continue
                    low, high = (i, j) if i < j else (j, i)
                    # the pair (low, high)'s place in the row-major strict upper triangle
                    weight = g[head + low * count - low * (low + 1) // 2 + high - low - 1]
                    vj = vectors[j]
                    for d in range(dim):
                        total[d] += weight * vj[d]
                if i < first:
                    grad_bottom[b] = total
                else:
                    grad_pooled[b, i - first] = total


def uses_kernels(pooled: torch.Tensor, bottom: torch.Tensor | None) -> bool:
    """Whether `interaction` takes the numba kernels for these tensors (module docstring)."""
    tensors = [pooled] if bottom is None else [pooled, bottom]
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
    )


def _arrays(bottom: torch.Tensor | None, pooled: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    batch = pooled.shape[0]
    head = np.empty((batch, 0), dtype=np.float32) if bottom is None else bottom.detach().contiguous().numpy()
    return head, pooled.detach().contiguous().numpy()


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bottom: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        # contiguous once, here: the backward reads the saved copies as they are
        pooled = pooled.detach().contiguous()
        bottom = None if bottom is None else bottom.detach().contiguous()
        head, vectors = _arrays(bottom, pooled)
        batch, features, _ = vectors.shape
        count = features + (1 if bottom is not None else 0)
        out = torch.empty(batch, head.shape[1] + count * (count - 1) // 2, dtype=torch.float32)
        with PARALLEL_LAUNCH:
            _forward(head, vectors, out.numpy())
        ctx.has_bottom = bottom is not None
        ctx.save_for_backward(*([pooled] if bottom is None else [bottom, pooled]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        saved = ctx.saved_tensors
        bottom, pooled = (saved[0], saved[1]) if ctx.has_bottom else (None, saved[0])
        head, vectors = _arrays(bottom, pooled)
        grad_bottom = torch.empty(head.shape, dtype=torch.float32)
        grad_pooled = torch.empty(vectors.shape, dtype=torch.float32)
        with PARALLEL_LAUNCH:
            _backward(grad.contiguous().numpy(), head, vectors, grad_bottom.numpy(), grad_pooled.numpy())
        return (grad_bottom if ctx.has_bottom else None), grad_pooled


def interaction(bottom: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
    """(bottom (B, D) | None, pooled (B, F, D)) -> (B, [D +] N (N - 1) / 2) through the kernels; the
    caller checks `uses_kernels` first."""
    result: torch.Tensor = _DotInteraction.apply(bottom, pooled)
    return result
