"""Sampled-softmax logits of each position against its own negatives, picked from the batch's pool.

The reference HSTU/SASRec trainers (generative-recommenders) draw N uniform negatives for every
position of the batch. Gathering B * L * N rows of width D costs B * L * N * D floats of memory
(655 MB for HSTU-large's batch: 128 users, 200 positions, 128 negatives, D = 50) and as much again
for their gradient. psrec's reader draws N uniform items per user (the batch's pool of B * N rows,
looked up once from the PS), and each real position picks its own N rows of that pool uniformly at
random. Every pick is a uniform item, as a draw of its own would be; two positions share an item only
as often as two picks hit the same of the pool's B * N rows.

The logits never materialise the gathered rows: a numba kernel computes

    logits[r, k] = q[r] . pool[picks[r, k]]

for the real positions r only (padded positions get 0), and a pick whose item is the position's own
next item (an accidental hit) gets the logits dtype's lowest value, so it drops out of the softmax and takes no
gradient, as the reference masks it. The backward pass computes dq[r] = sum_k g[r, k] pool[picks[r, k]]
and scatters g[r, k] q[r] into the pool's rows. Arithmetic is float32 whatever the inputs' dtype; the
logits come back in `q`'s dtype. Its oracle is the gather-and-multiply in PyTorch
(tests/models/test_pooled_negatives.py).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

LOWEST = float(np.finfo(np.float32).min)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _logits_kernel(
    queries: np.ndarray,  # (R, D) float32
    pool: np.ndarray,  # (U, D) float32, the pool's distinct items
    picks: np.ndarray,  # (R, N) int64 rows of the pool as drawn, in [0, M)
    rows_of: np.ndarray,  # (M,) int64: the row of `pool` that drawn row holds
    real: np.ndarray,  # (R,) bool
    targets: np.ndarray,  # (R,) int64 item numbers of each position's next item
    pool_ids: np.ndarray,  # (U,) int64 item numbers of `pool`'s rows
    out: np.ndarray,  # (R, N) float32
) -> None:
    rows, count = picks.shape
    dim = queries.shape[1]
    for r in range(rows):
        if not real[r]:
            for k in range(count):
                out[r, k] = 0.0
            continue
        target = targets[r]
        for k in range(count):
            m = rows_of[picks[r, k]]
            if pool_ids[m] == target:
                out[r, k] = LOWEST
                continue
            total = np.float32(0.0)
            for d in range(dim):
                total += queries[r, d] * pool[m, d]
            out[r, k] = total


@numba.njit(cache=True, nogil=True, fastmath=True)
def _grad_kernel(
    grad: np.ndarray,  # (R, N) float32
    queries: np.ndarray,  # (R, D) float32
    pool: np.ndarray,  # (U, D) float32
    picks: np.ndarray,  # (R, N) int64
    rows_of: np.ndarray,  # (M,) int64
    real: np.ndarray,  # (R,) bool
    targets: np.ndarray,  # (R,) int64
    pool_ids: np.ndarray,  # (U,) int64
    grad_queries: np.ndarray,  # (R, D) float32, zeroed
    grad_pool: np.ndarray,  # (U, D) float32, zeroed
) -> None:
    rows, count = picks.shape
    dim = queries.shape[1]
    total = np.zeros(dim, dtype=np.float32)  # grad_queries[r], summed in registers rather than memory
    for r in range(rows):
        if not real[r]:
            continue
        target = targets[r]
        total[:] = 0.0
        for k in range(count):
            m = rows_of[picks[r, k]]
            g = grad[r, k]
            if g == 0.0 or pool_ids[m] == target:
                continue
            for d in range(dim):
                total[d] += g * pool[m, d]
                grad_pool[m, d] += g * queries[r, d]
        grad_queries[r, :] = total


def _as_numpy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    return tensor.detach().to(dtype).contiguous().numpy()


class _PooledLogits(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        queries: torch.Tensor,
        pool: torch.Tensor,
        picks: torch.Tensor,
        rows_of: torch.Tensor,
        real: torch.Tensor,
        targets: torch.Tensor,
        pool_ids: torch.Tensor,
    ) -> torch.Tensor:
        arrays = (
            _as_numpy(queries, torch.float32),
            _as_numpy(pool, torch.float32),
            _as_numpy(picks, torch.int64),
            _as_numpy(rows_of, torch.int64),
            _as_numpy(real, torch.bool),
            _as_numpy(targets, torch.int64),
            _as_numpy(pool_ids, torch.int64),
        )
        out = np.empty(picks.shape, dtype=np.float32)
        _logits_kernel(*arrays, out)
        ctx.arrays = arrays
        ctx.dtypes = (queries.dtype, pool.dtype)
        logits = torch.from_numpy(out)
        if queries.dtype == torch.float32:
            return logits
        lowest = logits == LOWEST  # float32's lowest is -inf in bf16: the dtype's own lowest instead
        return logits.to(queries.dtype).masked_fill(lowest, torch.finfo(queries.dtype).min)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, pool, picks, rows_of, real, targets, pool_ids = ctx.arrays
        grad_queries = np.zeros_like(queries)
        grad_pool = np.zeros_like(pool)
        _grad_kernel(
            _as_numpy(grad, torch.float32),
            queries,
            pool,
            picks,
            rows_of,
            real,
            targets,
            pool_ids,
            grad_queries,
            grad_pool,
        )
        query_dtype, pool_dtype = ctx.dtypes
        return (
            torch.from_numpy(grad_queries).to(query_dtype),
            torch.from_numpy(grad_pool).to(pool_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def pooled_negatives_logits(
    queries: torch.Tensor,
    pool: torch.Tensor,
    picks: torch.Tensor,
    *,
    real: torch.Tensor,
    targets: torch.Tensor | None = None,
    pool_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(R, N) logits of R positions against their own N picks of the pool (module docstring).

    queries (R, D); pool (M, D); picks (R, N) row numbers in [0, M); real (R,) bool, False for padded
    positions (their logits are 0). With targets (R,), each position's next item number, and
    pool_ids (M,), the pool rows' item numbers (rows of one item must be equal, as a lookup returns
    them): a pick of the position's own target gets the dtype's lowest logit, and rows of the same
    item are scored as one. The kernels then read and write a table of the batch's distinct items,
    small enough to stay in cache; each item's gradient goes to its first row in the pool, so the
    per-item sum of the pool's gradient, which the PS takes, is unchanged.
    """
    if picks.dim() != 2 or queries.dim() != 2 or pool.dim() != 2 or picks.shape[0] != queries.shape[0]:
        raise ValueError(
            f"queries (R, D), pool (M, D) and picks (R, N) expected, got {tuple(queries.shape)}, "
            f"{tuple(pool.shape)}, {tuple(picks.shape)}"
        )
    if (targets is None) != (pool_ids is None):
        raise ValueError("targets and pool_ids go together: both (the hit mask) or neither")
    if targets is None or pool_ids is None:  # nothing to mask: no target equals an id
        targets = torch.full((queries.shape[0],), -1, dtype=torch.int64, device=queries.device)
        pool_ids = torch.full((pool.shape[0],), -2, dtype=torch.int64, device=queries.device)
        distinct, rows_of = pool, torch.arange(pool.shape[0], device=pool.device)
    else:
        pool_ids, rows_of = torch.unique(pool_ids, return_inverse=True)
        first = torch.full_like(pool_ids, pool.shape[0]).scatter_reduce(
            0, rows_of, torch.arange(pool.shape[0], device=pool.device), "amin"
        )
        distinct = pool[first]  # (U, D); autograd sends each row's gradient to the item's first row
    if queries.device.type != "cpu":  # the kernel is CPU's; elsewhere gather and multiply
        drawn = rows_of[picks]  # (R, N)
        logits = torch.einsum("rd,rnd->rn", queries, distinct[drawn])
        logits = logits.masked_fill(pool_ids[drawn] == targets.unsqueeze(-1), torch.finfo(logits.dtype).min)
        return logits * real.unsqueeze(-1).to(logits.dtype)
    result: torch.Tensor = _PooledLogits.apply(queries, distinct, picks, rows_of, real, targets, pool_ids)
    return result
