"""HSTU's pointwise aggregated attention, causal, with relative position and time biases.

Math (per head; n = the model's maximum sequence length, i a query position, j a key position, both
counted from the oldest item of the sequence):

    A(i, j) = SiLU(q_i . k_j + rab_p(i - j) + rab_t(i, j)) / n      for j <= i, else 0
    out_i   = sum_j A(i, j) v_j

(Zhai et al., "Actions Speak Louder than Words", ICML'24, eq. 2; no softmax: the weights are not
normalised over j, and the reference code divides by the padded length n.) The relative biases
(`RelativeAttentionBias`, one per block, as the reference):

- position: a learned weight per distance ``i - j`` in [0, n) (the reference keeps 2n - 1 weights,
  one per signed distance; causal attention reads only these n);
- time (when the batch has timestamps): a learned weight per bucket of ``t_query(i) - t_j``, where
  ``t_j`` is the time of item j and ``t_query(i)`` the time of the event predicted at position i (the
  next item's; the reference's ``ts[i + 1] - ts[j]``), bucketed as the reference buckets it:
  ``bucket(x) = clamp(floor(ln(max(|x|, 1)) / 0.301), 0, num_buckets)``.

Two implementations, equal within float rounding (tests/models/test_hstu.py):

- `jagged_attention` (the fast path): queries, keys and values packed (T, H, d) without padding
  (`psrec.models.jagged`); each `LengthGroup` of similar-length sequences runs as one batched matmul
  padded only to the group's longest member, under a causal (W, W) mask.
- `dense_attention` (the oracle): the left-padded (B, L, H, d) batch, every sequence padded to L, the
  mask built from real-item flags and positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as functional
from torch import nn

from psrec.models.jagged import JaggedLayout, from_group, split_groups, to_group

TIME_BUCKET_WIDTH = 0.301  # the reference's log-time bucket width (natural log units)


def time_buckets(gaps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of each time gap (int64 seconds): ``clamp(floor(ln(max(|gap|, 1)) / 0.301), 0, num_buckets)``."""
    logs = torch.log(gaps.abs().clamp(min=1).to(torch.float64)) / TIME_BUCKET_WIDTH
    return logs.long().clamp(0, num_buckets)


class RelativeAttentionBias(nn.Module):
    """rab_p by distance (``max_length`` weights) and rab_t by time bucket (``num_buckets + 1``)."""

    def __init__(self, max_length: int, *, num_buckets: int = 128) -> None:
        super().__init__()
        self.max_length = max_length
        self.num_buckets = num_buckets
        self.position_weights = nn.Parameter(torch.empty(max_length).normal_(0.0, 0.02))
        self.time_weights = nn.Parameter(torch.empty(num_buckets + 1).normal_(0.0, 0.02))

    def position(self, distance: torch.Tensor) -> torch.Tensor:
        """Bias of each query-key distance ``i - j`` (any shape, int64); negative distances read 0's weight
        (they are masked out: attention is causal)."""
        return self.position_weights[distance.clamp(0, self.max_length - 1)]

    def position_matrix(self, width: int) -> torch.Tensor:
        """(W, W) bias of query i and key j: rab_p(i - j) on and below the diagonal, 0 above it.

        Built as a Hankel matrix of the weights (`unfold`) and flipped, not by indexing: the gradient
        of an index with repeated entries is an accumulation, which was slow here."""
        weights = self.position_weights[: min(width, self.max_length)]
        if width > self.max_length:  # distances beyond max_length read the last weight
            weights = torch.cat([weights, weights[-1:].expand(width - self.max_length)])
        line = torch.cat([weights.flip(0), weights.new_zeros(width - 1)])  # (2W - 1,): w[W-1] .. w[0], 0..
        return line.unfold(0, width, 1).flip(0)  # [i, j] = line[W - 1 - i + j] = w[i - j], 0 for j > i

    def time(self, query_times: torch.Tensor, key_times: torch.Tensor) -> torch.Tensor:
        """(G, Lq) and (G, Lk) int64 times -> (G, Lq, Lk) bias of the bucketed gaps."""
        gaps = query_times.unsqueeze(-1) - key_times.unsqueeze(-2)  # (G, Lq, Lk)
        return self.time_weights[time_buckets(gaps, self.num_buckets)]


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JaggedLayout,
    *,
    scale: float,
    bias: RelativeAttentionBias | None = None,
    query_times: torch.Tensor | None = None,
    key_times: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal pointwise attention over packed sequences: q, k (T, H, dqk), v (T, H, dv) -> (T, H, dv).

    `scale` is 1 / n. With `bias`, rab_p is added, and rab_t too when `query_times` and `key_times`
    (T,) int64 are given.
    """
    outputs = []
    chunks = zip(
        layout.groups,
        split_groups(q, layout),
        split_groups(k, layout),
        split_groups(v, layout),
        split_groups(query_times, layout) if query_times is not None else [None] * len(layout.groups),
        split_groups(key_times, layout) if key_times is not None else [None] * len(layout.groups),
        strict=True,
    )
    for group, group_q, group_k, group_v, group_query_times, group_key_times in chunks:
        width = group.width
        queries = to_group(group_q, group).transpose(1, 2)  # (G, H, W, dqk)
        keys = to_group(group_k, group).transpose(1, 2)  # (G, H, W, dqk)
        values = to_group(group_v, group).transpose(1, 2)  # (G, H, W, dv)
        scores = torch.matmul(queries, keys.transpose(-1, -2))  # (G, H, W, W)
        if bias is not None:
            relative = bias.position_matrix(width).unsqueeze(0)  # (1, W, W)
            if group_query_times is not None and group_key_times is not None:
                relative = relative + bias.time(
                    to_group(group_query_times, group), to_group(group_key_times, group)
                )
            scores = scores + relative.unsqueeze(1).to(scores.dtype)  # (G or 1, 1, W, W)
        causal = torch.ones(width, width, dtype=scores.dtype, device=q.device).tril_().mul_(scale)  # (W, W)
        attended = torch.matmul(functional.silu(scores) * causal, values)  # (G, H, W, dv)
        outputs.append(from_group(attended.transpose(1, 2), group))  # (tokens, H, dv)
    if not outputs:
        return v.new_zeros(v.shape)
    return torch.cat(outputs)  # groups are contiguous runs of the packed order


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    bias: RelativeAttentionBias | None = None,
    times: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle on the left-padded batch: q, k (B, L, H, dqk), v (B, L, H, dv), mask (B, L) -> (B, L, H, dv).

    `times` (B, L + 1) int64: the items' times, then the time of the event after the last item; the
    query time of position i is ``times[:, i + 1]``. Outputs at padded positions are zero.
    """
    length = mask.shape[1]
    positions = mask.long().cumsum(dim=1) - 1  # (B, L): index from the oldest real item
    distance = positions.unsqueeze(2) - positions.unsqueeze(1)  # (B, L, L): i - j
    allowed = mask.unsqueeze(2) & mask.unsqueeze(1) & (distance >= 0)  # (B, L, L)
    scores = torch.einsum("bihd,bjhd->bhij", q, k)  # (B, H, L, L)
    if bias is not None:
        relative = bias.position(distance)  # (B, L, L)
        if times is not None:
            relative = relative + bias.time(times[:, 1 : length + 1], times[:, :length])
        scores = scores + relative.unsqueeze(1).to(scores.dtype)
    weights = functional.silu(scores) * allowed.unsqueeze(1).to(scores.dtype) * scale
    return torch.einsum("bhij,bjhd->bihd", weights, v)  # padded queries: all weights 0
