"""Jagged sequences: a batch of variable-length sequences packed into one (T, ...) tensor, no padding.

psrec's sequence batches arrive left-padded, ``(B, L, D)`` with a ``(B, L)`` bool mask (True = real
item, real items right-aligned). `JaggedLayout.from_mask` describes the same batch packed: the
T = sum of lengths real tokens, one sequence after another (``offsets``), so that position-wise work
(projections, layer norms, gating) runs on T rows instead of B * L.

Sequences are packed **longest first** (a stable sort by length), which makes the attention's length
groups contiguous runs of packed tokens. Quadratic work (attention) runs per `LengthGroup`: a run of
sequences of similar length padded only to the group's longest member. The groups are the partition
of the sorted sequences into contiguous runs that minimises

    sum over groups of  count * width^2  +  group_overhead

(``width`` = the group's longest length; ``group_overhead`` in the same units, query-key pairs, prices
the fixed cost of one more group's kernels), found exactly by dynamic programming over the sorted
lengths. One group of width L is the dense padded computation; a group per distinct length has no
padding at all.

Worked example, L = 4, mask rows [0,1,1,1], [0,0,0,1], [0,0,1,1] (lengths 3, 1, 2)::

    order        = [0, 2, 1]                    sequences, longest first
    offsets      = [0, 3, 5, 6]                 sequence order[i] is values[offsets[i]:offsets[i+1]]
    padded_index = [1, 2, 3, 10, 11, 7]         each packed token's flat index b * L + column
    positions    = [0, 1, 2, 0, 1, 0]           each token's index within its own sequence

``pack`` gathers ``padded.flatten(0, 1)[padded_index]``; ``unpack`` puts the T rows back (zeros at
padding); `to_group` / `from_group` do the same between a group's tokens and its padded block. Each
index hits a row at most once, so every backward is a gather or a copy, never an accumulation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# A group costs its padded query-key pairs plus this many pairs' worth of fixed cost (its kernel
# launches). On ML-1M batches (128 users, lengths up to 200, 2 CPU cores) values from 8,192 to 32,768
# gave the fastest HSTU steps; 2,048 (many small groups) and one group (padding to the longest) were
# slower by 15-100%.
GROUP_OVERHEAD = 128 * 128


@dataclass(frozen=True)
class LengthGroup:
    """A contiguous run of packed sequences padded to its longest: ``count`` x ``width``.

    ``real`` (tokens,) are the flat padded slots of the group's real tokens, in packed order: token
    ``start + t`` sits at ``padded.flatten(0, 1)[real[t]]``.
    """

    start: int  # first packed token of the group
    tokens: int  # real tokens in the group
    count: int  # sequences
    width: int  # the group's longest length
    real: torch.Tensor  # (tokens,) int64
    lengths: torch.Tensor  # (count,) int64


@dataclass(frozen=True)
class JaggedLayout:
    """A left-padded (B, L) batch packed longest first; see the module docstring."""

    batch_size: int
    max_length: int  # L, the padded width
    order: torch.Tensor  # (B,) int64: the packed order of the batch's rows
    lengths: torch.Tensor  # (B,) int64: lengths in packed order
    offsets: torch.Tensor  # (B + 1,) int64
    padded_index: torch.Tensor  # (T,) int64 flat index b * L + column of each packed token
    positions: torch.Tensor  # (T,) int64 index of each token within its sequence (0 = oldest)
    groups: tuple[LengthGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.padded_index.shape[0])

    @classmethod
    def from_mask(cls, mask: torch.Tensor, *, group_overhead: int = GROUP_OVERHEAD) -> JaggedLayout:
        """The layout of a left-padded batch: `mask` (B, L) bool, each row's real items right-aligned."""
        if mask.ndim != 2:
            raise ValueError(f"JaggedLayout.from_mask: mask must be (B, L), got {tuple(mask.shape)}")
        batch, width = mask.shape
        device = mask.device
        lengths_host = mask.sum(dim=1).cpu().numpy().astype(np.int64)  # (B,)
        order_host = np.argsort(-lengths_host, kind="stable")
        sorted_lengths = lengths_host[order_host]
        offsets_host = np.concatenate(([0], np.cumsum(sorted_lengths))).astype(np.int64)
        total = int(offsets_host[-1])
        # token t of sorted sequence i: column (L - length_i) + (t - offsets_i) of row order_i
        sequence_of_token = np.repeat(np.arange(batch), sorted_lengths)
        positions_host = np.arange(total, dtype=np.int64) - offsets_host[sequence_of_token]
        rows = order_host[sequence_of_token]
        columns = width - sorted_lengths[sequence_of_token] + positions_host
        padded_host = rows * width + columns

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        groups = tuple(
            _group(offsets_host, sorted_lengths, start, stop, tensor)
            for start, stop in partition_by_length(sorted_lengths, group_overhead=group_overhead)
        )
        return cls(
            batch_size=batch,
            max_length=width,
            order=tensor(order_host),
            lengths=tensor(sorted_lengths),
            offsets=tensor(offsets_host),
            padded_index=tensor(padded_host),
            positions=tensor(positions_host),
            groups=groups,
        )


def _group(
    offsets: np.ndarray,
    lengths: np.ndarray,
    start: int,
    stop: int,
    tensor: Callable[[np.ndarray], torch.Tensor],
) -> LengthGroup:
    """The `LengthGroup` of sorted sequences [start, stop)."""
    group_lengths = lengths[start:stop]
    width = int(group_lengths[0])
    columns = np.arange(width)[None, :]  # (1, W)
    valid = columns < group_lengths[:, None]  # (count, W)
    real = np.flatnonzero(valid.reshape(-1))
    return LengthGroup(
        start=int(offsets[start]),
        tokens=int(offsets[stop] - offsets[start]),
        count=stop - start,
        width=width,
        real=tensor(real),
        lengths=tensor(group_lengths),
    )


def partition_by_length(
    lengths: np.ndarray, *, group_overhead: int = GROUP_OVERHEAD
) -> list[tuple[int, int]]:
    """Cut lengths sorted longest first into contiguous runs [start, stop) minimising
    ``sum(count * width^2) + group_overhead * groups`` (dynamic programming; empty sequences dropped)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and np.any(np.diff(lengths) > 0):
        raise ValueError("partition_by_length: lengths must be sorted longest first")
    count = int(np.count_nonzero(lengths))
    if count == 0:
        return []
    squares = lengths[:count].astype(np.float64) ** 2
    best = np.zeros(count + 1)  # best[i]: cheapest cut of the first i sequences
    cut = np.zeros(count + 1, dtype=np.int64)
    starts = np.arange(count)
    for stop in range(1, count + 1):
        # group [j, stop) costs (stop - j) * lengths[j]^2 + overhead
        costs = best[:stop] + (stop - starts[:stop]) * squares[:stop] + group_overhead
        cut[stop] = int(np.argmin(costs))
        best[stop] = costs[cut[stop]]
    runs = []
    stop = count
    while stop > 0:
        runs.append((int(cut[stop]), stop))
        stop = int(cut[stop])
    return runs[::-1]


class _Gather(torch.autograd.Function):
    """``source.flatten(0, 1)[index]`` for an index that hits each source row at most once.

    Its gradient is a plain copy back (`index_copy` into zeros), not autograd's `index_add`, whose
    accumulation was the single largest cost of an HSTU step here (each row is hit once: nothing to add).
    """

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        flat = source.flatten(0, 1)
        ctx.save_for_backward(index)
        ctx.source_shape = source.shape
        return flat.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        shape = ctx.source_shape
        flat = grad.new_zeros((shape[0] * shape[1], *shape[2:]))
        return flat.index_copy_(0, index, grad).view(shape), None


class _Scatter(torch.autograd.Function):
    """Rows of `values` copied to slots `index` of a zero (rows, ...) tensor; the gradient is a gather."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return values.new_zeros((rows, *values.shape[1:])).index_copy_(0, index, values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def pack(padded: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
    """(B, L, ...) -> (T, ...): the real tokens, in the layout's packed order."""
    return _Gather.apply(padded, layout.padded_index)


def unpack(values: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
    """(T, ...) -> (B, L, ...) with zeros at padding; the inverse of `pack` on real positions."""
    flat = _Scatter.apply(values, layout.padded_index, layout.batch_size * layout.max_length)
    return flat.view(layout.batch_size, layout.max_length, *values.shape[1:])


def split_groups(values: torch.Tensor, layout: JaggedLayout) -> tuple[torch.Tensor, ...]:
    """Packed (T, ...) -> each `LengthGroup`'s tokens (tokens_g, ...), views in group order."""
    return values.split([group.tokens for group in layout.groups])


def to_group(tokens: torch.Tensor, group: LengthGroup) -> torch.Tensor:
    """A group's tokens (tokens, ...) -> its padded (count, width, ...), zeros at padding."""
    padded = _Scatter.apply(tokens, group.real, group.count * group.width)
    return padded.view(group.count, group.width, *tokens.shape[1:])


def from_group(padded: torch.Tensor, group: LengthGroup) -> torch.Tensor:
    """A group's padded (count, width, ...) -> its real tokens (tokens, ...), in packed order."""
    return _Gather.apply(padded, group.real)
