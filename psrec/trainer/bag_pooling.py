"""Pooling of multi-valued (bag) features: one fused pool-and-gather forward and scatter backward.

A bag feature holds a variable number of ids per sample (user histories, tags). Its pooled
embedding is the sum (or mean) of the rows of its ids::

    out[b, f] = sum_{i in bag(f, b)} rows[index[i]]        # (B, F, D); an empty bag gives zeros
    mean:       out[b, f] /= len(bag(f, b))                # empty bags stay zero

`rows` is the batch's fused buffer of unique rows (every table back to back,
`psrec.trainer.lookup.LookupPlan.bag_offsets`), `index` the position of every id among those rows,
and bag (f, b) is ``index[offsets[f, b]:offsets[f, b + 1]]``. One kernel pools every feature of the
batch into the (B, F, D) model input, in parallel over samples (each sample's output rows belong to
one thread), instead of one ``embedding_bag`` per feature and a ``stack``.

The backward is the transposed sum, ``grad_rows[r] = sum over ids i of row r of grad[b, f] (/ len)``.
A scatter (``grad_rows[index[i]] += grad[b, f]`` for every id) reads and writes a random row per
id, and the rows of bag features outgrow the cache (350k unique rows of dim 64 are 90 MB); so the
ids are sorted by row once (`transpose_bags`: a counting sort, in the planner thread ahead of the
step, `LookupPlan.bag_transposed`), and the backward then gathers each row's gradients and writes
the row once, in parallel over rows: no two threads write one row, and every sum runs in the same
order (deterministic). The incoming gradient is read in whatever layout it has when it is a run of
whole rows (DLRM's slice of the interaction's input).

bfloat16: the output of a bf16-autocast model's embedding path is the float32 sum rounded once to
bfloat16 (round to nearest even, as PyTorch does); bfloat16 gradients are widened and summed in
float32. The rows and their gradients stay float32.

The oracle is ``nn.EmbeddingBag`` (tests/trainer/test_bag_pooling.py).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

from psrec.allocator import ReusableBuffers
from psrec.threads import PARALLEL_LAUNCH
from psrec.trainer.pooling import enclosing_rows, numpy_bits

MODES = ("sum", "mean")
_ROW_CHUNK = 1024  # rows per task of the bf16 backward


@numba.njit(cache=True, nogil=True, inline="always")
def _bag_sum(rows: np.ndarray, index: np.ndarray, start: int, stop: int, acc: np.ndarray) -> bool:
    """acc = sum of rows[index[start:stop]]; False when an index is out of range (acc then partial)."""
    count = rows.shape[0]
    dim = acc.shape[0]
    for d in range(dim):
        acc[d] = 0.0
    i = start
    # four ids a pass over `acc` (one load and store of it instead of four), summed in id order
    while i + 4 <= stop:
        r0, r1, r2, r3 = index[i], index[i + 1], index[i + 2], index[i + 3]
        if min(r0, r1, r2, r3) < 0 or max(r0, r1, r2, r3) >= count:
            return False
        s0, s1, s2, s3 = rows[r0], rows[r1], rows[r2], rows[r3]
        for d in range(dim):
            acc[d] = (((acc[d] + s0[d]) + s1[d]) + s2[d]) + s3[d]
        i += 4
    for k in range(i, stop):
        row = index[k]
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


@numba.njit(cache=True, nogil=True)
def _transpose_kernel(
    index: np.ndarray, offsets: np.ndarray, num_rows: int, row_starts: np.ndarray, owners: np.ndarray
) -> None:
    """Counting sort of the ids by row: row r's ids belong to bags owners[row_starts[r]:row_starts[r + 1]]
    (bag (f, b) as b * F + f), in the order of `index` (stable)."""
    features, batch = offsets.shape[0], offsets.shape[1] - 1
    for r in range(num_rows + 1):
        row_starts[r] = 0
    for f in range(features):
        for i in range(offsets[f, 0], offsets[f, batch]):
            row_starts[index[i] + 1] += 1
    for r in range(num_rows):
        row_starts[r + 1] += row_starts[r]
    fill = row_starts[:-1].copy()
    for f in range(features):
        for b in range(batch):
            for i in range(offsets[f, b], offsets[f, b + 1]):
                row = index[i]
                owners[fill[row]] = b * features + f
                fill[row] += 1


def transpose_bags(index: np.ndarray, offsets: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_starts (num_rows + 1,), owners (ids,)): for each row the bags its ids sit in, the
    backward's layout (see the module docstring). Computed once per batch, ahead of the step by the
    lookup plan; `index` must lie in [0, num_rows) (the forward checks it)."""
    row_starts = np.empty(num_rows + 1, dtype=np.int64)
    owners = np.empty(index.shape[0], dtype=np.int32)
    _transpose_kernel(index, offsets, num_rows, row_starts, owners)
    return row_starts, owners


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather_gradients(
    out: np.ndarray,
    row_starts: np.ndarray,
    owners: np.ndarray,
    offsets: np.ndarray,
    grad: np.ndarray,
    first: int,
    mean: bool,
) -> None:
    """out[r] = sum of grad[b, first + f] (/ len) over the bags (f, b) of row r's ids (zero for none);
    float32 gradients, each row written once, by one thread, in a fixed order."""
    features = offsets.shape[0]
    dim = out.shape[1]
    for r in numba.prange(out.shape[0]):
        target = out[r]
        for d in range(dim):
            target[d] = 0.0
        k, stop = row_starts[r], row_starts[r + 1]
        if not mean:  # four gradients a pass over the row (as `_bag_sum`), in the same order
            while k + 4 <= stop:
                o0, o1, o2, o3 = owners[k], owners[k + 1], owners[k + 2], owners[k + 3]
                s0 = grad[o0 // features, first + o0 % features]
                s1 = grad[o1 // features, first + o1 % features]
                s2 = grad[o2 // features, first + o2 % features]
                s3 = grad[o3 // features, first + o3 % features]
                for d in range(dim):
                    target[d] = (((target[d] + s0[d]) + s1[d]) + s2[d]) + s3[d]
                k += 4
        for j in range(k, stop):
            owner = owners[j]
            b, f = owner // features, owner % features
            source = grad[b, first + f]
            if mean:
                scale = np.float32(1.0) / np.float32(offsets[f, b + 1] - offsets[f, b])
                for d in range(dim):
                    target[d] += source[d] * scale
            else:
                for d in range(dim):
                    target[d] += source[d]


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather_gradients_bf16(
    out: np.ndarray,
    row_starts: np.ndarray,
    owners: np.ndarray,
    offsets: np.ndarray,
    grad: np.ndarray,
    first: int,
    mean: bool,
) -> None:
    """`_gather_gradients` of bfloat16 gradients (their uint16 bits), widened and summed in float32."""
    features = offsets.shape[0]
    num_rows, dim = out.shape
    chunks = (num_rows + _ROW_CHUNK - 1) // _ROW_CHUNK
    for c in numba.prange(chunks):
        widened = np.empty(dim, dtype=np.uint32)  # one scratch row per chunk of rows
        as_float = widened.view(np.float32)
        for r in range(c * _ROW_CHUNK, min(num_rows, (c + 1) * _ROW_CHUNK)):
            target = out[r]
            for d in range(dim):
                target[d] = 0.0
            for k in range(row_starts[r], row_starts[r + 1]):
                owner = owners[k]
                b, f = owner // features, owner % features
                source = grad[b, first + f]
                scale = np.float32(1.0)
                if mean:
                    scale = np.float32(1.0) / np.float32(offsets[f, b + 1] - offsets[f, b])
                for d in range(dim):
                    widened[d] = np.uint32(source[d]) << np.uint32(16)
                for d in range(dim):
                    target[d] += as_float[d] * scale


class _PoolBags(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        index: np.ndarray,
        offsets: np.ndarray,
        mean: bool,
        dtype: torch.dtype,
        transposed: tuple[np.ndarray, np.ndarray] | None,
        buffers: ReusableBuffers | None,
    ) -> torch.Tensor:
        ctx.index, ctx.offsets, ctx.mean, ctx.transposed = index, offsets, mean, transposed
        ctx.buffers = buffers
        ctx.num_rows = rows.shape[0]
        source = rows.detach().numpy()
        features, batch = offsets.shape[0], offsets.shape[1] - 1
        out = torch.empty(batch, features, rows.shape[1], dtype=dtype)
        bad = np.zeros(batch, dtype=np.uint8)
        kernel = _pool_bfloat16 if dtype == torch.bfloat16 else _pool_float32
        with PARALLEL_LAUNCH:
            kernel(source, index, offsets, mean, numpy_bits(out), bad)
        if bad.any():
            sample = int(np.flatnonzero(bad)[0])
            raise IndexError(
                f"pool_bags: a bag of sample {sample} has an index outside the {rows.shape[0]} rows"
            )
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        if grad.dtype not in (torch.float32, torch.bfloat16):
            grad = grad.float()
        row_starts, owners = ctx.transposed or transpose_bags(ctx.index, ctx.offsets, ctx.num_rows)
        shape = (ctx.num_rows, grad.shape[2])  # every row is written
        out = (
            torch.from_numpy(ctx.buffers.empty(shape, np.float32))  # reused once the push released it
            if ctx.buffers is not None
            else torch.empty(shape, dtype=torch.float32)
        )
        whole, first = enclosing_rows(grad.detach())
        with PARALLEL_LAUNCH:
            if whole.dtype == torch.bfloat16:
                bits = whole.view(torch.int16).numpy().view(np.uint16)
                _gather_gradients_bf16(out.numpy(), row_starts, owners, ctx.offsets, bits, first, ctx.mean)
            else:
                _gather_gradients(
                    out.numpy(), row_starts, owners, ctx.offsets, whole.numpy(), first, ctx.mean
                )
        return out, None, None, None, None, None, None


def pool_bags(
    rows: torch.Tensor,
    index: np.ndarray,
    offsets: np.ndarray,
    *,
    mode: str = "sum",
    dtype: torch.dtype = torch.float32,
    transposed: tuple[np.ndarray, np.ndarray] | None = None,
    buffers: ReusableBuffers | None = None,
) -> torch.Tensor:
    """(B, F, D) pooled bags (see the module docstring), differentiable in `rows`.

    `rows` (U, D) float32 and C-contiguous; `index` (N,) int64 positions into `rows`; `offsets`
    (F, B + 1) int64, bag (f, b) = ``index[offsets[f, b]:offsets[f, b + 1]]`` (non-decreasing along
    b); `mode` "sum" or "mean"; `dtype` float32 or bfloat16 (the output; gradients sum in float32);
    `transposed` the backward's layout (`transpose_bags`) when already computed (else the backward
    computes it); `buffers` the pool the backward takes its gradient array from
    (`psrec.allocator.ReusableBuffers`; None: a new array each time).
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
    if transposed is not None and transposed[0].shape[0] != rows.shape[0] + 1:
        raise ValueError(
            f"pool_bags: transposed is for {transposed[0].shape[0] - 1} rows, not {rows.shape[0]}"
        )
    result: torch.Tensor = _PoolBags.apply(rows, index, offsets, mode == "mean", dtype, transposed, buffers)
    return result
