"""Pooling of multi-valued (bag) features: one fused pool-and-gather forward and scatter backward.

A bag feature holds a variable number of ids per sample (user histories, tags). Its pooled
embedding is the sum (or mean) of the rows of its ids::

    out[b, f] = sum_{i in bag(f, b)} rows[index[i]]        # (B, F, D); an empty bag gives zeros
    mean:       out[b, f] /= len(bag(f, b))                # empty bags stay zero

`rows` is the batch's fused buffer of unique rows (every table back to back,
`psrec.train.lookup.LookupPlan.bag_offsets`), `index` the position of every id among those rows,
and bag (f, b) is ``index[offsets[f, b]:offsets[f, b + 1]]``. One kernel pools every feature of the
batch into the (B, F, D) model input, in parallel over samples (each sample's output rows belong to
one thread), instead of one ``embedding_bag`` per feature and a ``stack``.

The backward is the transposed sum, ``grad_rows[index[i]] += grad[b, f] (/ len)``. Samples share
rows, so threads split the embedding dimension instead (16-column blocks, a cache line of float32
each): each thread adds its columns of every bag, no two threads write the same cache line, and
the sums run in the same order every time (deterministic, unlike a sort-free parallel scatter).
PyTorch's own ``embedding_bag`` backward sorts the indices first. The incoming gradient is read in
whatever layout it has when it is a run of whole rows (DLRM's slice of the interaction's input).

bfloat16: the output of a bf16-autocast model's embedding path is the float32 sum rounded once to
bfloat16 (round to nearest even, as PyTorch does); bfloat16 gradients are widened and summed in
float32. The rows and their gradients stay float32.

The oracle is ``nn.EmbeddingBag`` (tests/train/test_bag_pooling.py).
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
import torch

from psrec.train.pooling import _enclosing_rows, _numpy_bits

MODES = ("sum", "mean")
# numba's workqueue threading layer (the one left where neither OpenMP nor TBB loads) aborts the
# process when two Python threads launch parallel kernels at once; launches are serialised.
_LAUNCH = threading.Lock()


@numba.njit(cache=True, nogil=True, inline="always")
def _bag_sum(rows: np.ndarray, index: np.ndarray, start: int, stop: int, acc: np.ndarray) -> bool:
    """acc = sum of rows[index[start:stop]]; False when an index is out of range (acc then partial)."""
    count = rows.shape[0]
    dim = acc.shape[0]
    for d in range(dim):
        acc[d] = 0.0
    for i in range(start, stop):
        row = index[i]
        if row < 0 or row >= count:
            return False
        source = rows[row]
        for d in range(dim):
            acc[d] += source[d]
    return True


@numba.njit(cache=True, nogil=True, parallel=True)
def _pool_float32(
    rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mean: bool, out: np.ndarray, bad: np.ndarray
) -> None:
    """out[b, f] = pooled bag (f, b) in float32; bad[b] = 1 where a bag of sample b has an index out
    of range."""
    features, batch = offsets.shape[0], offsets.shape[1] - 1
    for b in numba.prange(batch):
        for f in range(features):
            start, stop = offsets[f, b], offsets[f, b + 1]
            acc = out[b, f]
            if not _bag_sum(rows, index, start, stop, acc):
                bad[b] = 1
            elif mean and stop > start:
                scale = np.float32(1.0) / np.float32(stop - start)
                for d in range(acc.shape[0]):
                    acc[d] *= scale


@numba.njit(cache=True, nogil=True, parallel=True)
def _pool_bfloat16(
    rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, mean: bool, out: np.ndarray, bad: np.ndarray
) -> None:
    """`_pool_float32` with the float32 sums rounded to bfloat16 bits (uint16) into `out`:
    round to nearest even as PyTorch does; a NaN becomes the quiet NaN 0x7FC0."""
    features, batch = offsets.shape[0], offsets.shape[1] - 1
    dim = rows.shape[1]
    for b in numba.prange(batch):
        acc = np.empty(dim, dtype=np.float32)
        bits = acc.view(np.uint32)
        for f in range(features):
            start, stop = offsets[f, b], offsets[f, b + 1]
            if not _bag_sum(rows, index, start, stop, acc):
                bad[b] = 1
                continue
            if mean and stop > start:
                scale = np.float32(1.0) / np.float32(stop - start)
                for d in range(dim):
                    acc[d] *= scale
            target = out[b, f]
            for d in range(dim):
                value = bits[d]
                if (value & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    target[d] = np.uint16(0x7FC0)
                else:
                    rounding = np.uint32(0x7FFF) + ((value >> np.uint32(16)) & np.uint32(1))
                    target[d] = np.uint16((value + rounding) >> np.uint32(16))


@numba.njit(cache=True, nogil=True, parallel=True)
def _scatter_bags(
    out: np.ndarray,
    index: np.ndarray,
    offsets: np.ndarray,
    grad: np.ndarray,
    first: int,
    mean: bool,
    blocks: int,
) -> None:
    """out[index[i]] += grad[b, first + f] (/ len) for every id i of bag (f, b); float32 gradients.
    Thread k adds columns [k * dim / blocks, (k + 1) * dim / blocks) (multiples of 16)."""
    features, batch = offsets.shape[0], offsets.shape[1] - 1
    dim = out.shape[1]
    for k in numba.prange(blocks):
        low, high = (dim * k // blocks) // 16 * 16, (dim * (k + 1) // blocks) // 16 * 16
        if k == blocks - 1:
            high = dim
        for f in range(features):
            for b in range(batch):
                start, stop = offsets[f, b], offsets[f, b + 1]
                if stop == start:
                    continue
                source = grad[b, first + f]
                scale = np.float32(1.0) / np.float32(stop - start) if mean else np.float32(1.0)
                for i in range(start, stop):
                    target = out[index[i]]
                    for d in range(low, high):
                        target[d] += source[d] * scale


@numba.njit(cache=True, nogil=True, parallel=True)
def _scatter_bags_bf16(
    out: np.ndarray,
    index: np.ndarray,
    offsets: np.ndarray,
    grad: np.ndarray,
    first: int,
    mean: bool,
    blocks: int,
) -> None:
    """`_scatter_bags` of bfloat16 gradients (their uint16 bits), widened and summed in float32."""
    features, batch = offsets.shape[0], offsets.shape[1] - 1
    dim = out.shape[1]
    for k in numba.prange(blocks):
        low, high = (dim * k // blocks) // 16 * 16, (dim * (k + 1) // blocks) // 16 * 16
        if k == blocks - 1:
            high = dim
        widened = np.empty(dim, dtype=np.uint32)
        as_float = widened.view(np.float32)
        for f in range(features):
            for b in range(batch):
                start, stop = offsets[f, b], offsets[f, b + 1]
                if stop == start:
                    continue
                source = grad[b, first + f]
                scale = np.float32(1.0) / np.float32(stop - start) if mean else np.float32(1.0)
                for d in range(low, high):
                    widened[d] = np.uint32(source[d]) << np.uint32(16)
                for i in range(start, stop):
                    target = out[index[i]]
                    for d in range(low, high):
                        target[d] += as_float[d] * scale


def column_blocks(dim: int, threads: int) -> int:
    """How many column blocks the backward splits `dim` into: one per thread, at least 16 columns
    (a float32 cache line) each, so that no two threads write one cache line."""
    return max(1, min(threads, dim // 16))


class _PoolBags(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        index: np.ndarray,
        offsets: np.ndarray,
        mean: bool,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.index, ctx.offsets, ctx.mean = index, offsets, mean
        ctx.num_rows = rows.shape[0]
        source = rows.detach().numpy()
        features, batch = offsets.shape[0], offsets.shape[1] - 1
        out = torch.empty(batch, features, rows.shape[1], dtype=dtype)
        bad = np.zeros(batch, dtype=np.uint8)
        kernel = _pool_bfloat16 if dtype == torch.bfloat16 else _pool_float32
        with _LAUNCH:
            kernel(source, index, offsets, mean, _numpy_bits(out), bad)
        if bad.any():
            sample = int(np.flatnonzero(bad)[0])
            raise IndexError(
                f"pool_bags: a bag of sample {sample} has an index outside the {rows.shape[0]} rows"
            )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if grad.dtype not in (torch.float32, torch.bfloat16):
            grad = grad.float()
        dim = grad.shape[2]
        out = torch.zeros(ctx.num_rows, dim, dtype=torch.float32)
        whole, first = _enclosing_rows(grad.detach())
        blocks = column_blocks(dim, numba.get_num_threads())
        with _LAUNCH:
            if whole.dtype == torch.bfloat16:
                bits = whole.view(torch.int16).numpy().view(np.uint16)
                _scatter_bags_bf16(out.numpy(), ctx.index, ctx.offsets, bits, first, ctx.mean, blocks)
            else:
                _scatter_bags(out.numpy(), ctx.index, ctx.offsets, whole.numpy(), first, ctx.mean, blocks)
        return out, None, None, None, None


def pool_bags(
    rows: torch.Tensor,
    index: np.ndarray,
    offsets: np.ndarray,
    *,
    mode: str = "sum",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(B, F, D) pooled bags (see the module docstring), differentiable in `rows`.

    `rows` (U, D) float32 and C-contiguous; `index` (N,) int64 positions into `rows`; `offsets`
    (F, B + 1) int64, bag (f, b) = ``index[offsets[f, b]:offsets[f, b + 1]]`` (non-decreasing along
    b); `mode` "sum" or "mean"; `dtype` float32 or bfloat16 (the output; gradients sum in float32).
    """
    if mode not in MODES:
        raise ValueError(f"pool_bags: mode must be one of {MODES}, not {mode!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pool_bags: dtype must be float32 or bfloat16, not {dtype}")
    if rows.dtype != torch.float32 or rows.dim() != 2:
        raise ValueError(f"pool_bags: rows must be 2-D float32, got {tuple(rows.shape)} {rows.dtype}")
    if offsets.ndim != 2 or offsets.shape[1] < 1:
        raise ValueError(f"pool_bags: offsets must be (features, batch + 1), got shape {offsets.shape}")
    if offsets.size and (offsets.min() < 0 or offsets.max() > index.shape[0]):
        raise ValueError(f"pool_bags: offsets must lie in [0, {index.shape[0]}] (the number of ids)")
    if not rows.is_contiguous():
        rows = rows.contiguous()
    index = np.ascontiguousarray(index, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    result: torch.Tensor = _PoolBags.apply(rows, index, offsets, mode == "mean", dtype)
    return result
