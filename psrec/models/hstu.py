"""HSTU (Zhai et al., "Actions Speak Louder than Words", ICML'24): the generative recommender's encoder.

Math (B = batch, L = sequence length <= n = ``max_length``, D = embedding dim, H = heads, dqk / dv =
``attention_dim`` / ``linear_dim`` per head; positions counted from the oldest item, 0-based):

    x_0 = Dropout(E[seq] * sqrt(D) + P[position]) * mask                 # (B, L, D), learned positions
    one HSTU block (pre-norm, residual; Norm = layer norm without affine, eps 1e-6):
        U, V, Q, K = Split(SiLU(Norm(x) W_uvqk))                         # W_uvqk (D, 2 H dv + 2 H dqk)
        A V        = pointwise causal attention per head                  # psrec.models.hstu_attention
                     A(i, j) = SiLU(Q_i . K_j + rab_p(i - j) + rab_t(i, j)) / n,  j <= i
        x          = x + W_o Dropout(U * Norm(A V)) + b_o
    u_t = x_t / ||x_t||,   r_t(i) = <u_t, E[i] / ||E[i]||> / temperature   # cosine / temperature

(the paper's eq. 1-3 as the reference code computes them: facebookresearch/generative-recommenders,
research/modeling/sequential/hstu.py with its ML-1M configs). The reference divides by its padded
length (max length + 11 output slots); the layer norm of A V cancels any constant scale, so n =
``max_length`` here. Item embeddings are the PS table's rows,
the same rows in (``seq``) and out (``pos``, negatives, candidates): tied. Weights start as the
reference's: W_uvqk normal(0, 0.02), W_o Xavier-uniform (PyTorch's default bias), P Xavier-normal,
relative-bias weights normal(0, 0.02).

The blocks run **jagged**: `HSTUStack` packs the batch's real tokens (`psrec.models.jagged`), runs the
position-wise work on those T rows and the attention per length group, and unpacks once at the end.
``jagged=False`` runs the same weights on the padded batch (`psrec.models.hstu_attention.dense_attention`):
the oracle the jagged path is tested against.

Inputs (``ModelInput``), as SASRec's (psrec/models/sasrec.py):

- ``"seq"`` (B, L, D) with ``masks["seq"]``: the left-padded history, most recent last; optional
  ``timestamps["seq"]`` (B, L + 1) for the time bias (without it, rab_p only).
- training: ``"pos"`` (B, L, D) the next items, and the loss's negatives:
  ``loss="sampled_softmax"`` (the reference's): ``"negatives"`` (B, N, D), N items per user shared by
  its positions; ``mean(logsumexp([r_pos, r_neg_1..N]) - r_pos)`` over real positions.
  ``loss="bce"``: ``"neg"`` (B, L, D), one negative per position; ``mean BCE(r_pos, 1) + mean BCE(r_neg, 0)``.
- evaluation: ``"candidates"`` (B, C, D), (N, D) or (1, N, D), scored against the last position.

Stages (``stages()``): `HSTUEmbedding` (ModelInput -> {"hidden", "mask", ["times"], pass-through
targets}), `HSTUStack` (with ``block_parts()`` for a pipeline), `HSTUHead` (normalisation and the
logits: "pos_logits", "neg_logits", "negatives_logits" (B, L, N), "candidate_logits").

Train it with ``psrec train examples/ml1m_hstu.yaml --data-dir ../shared/data``; its tests:
``pytest tests/models/test_hstu.py tests/train/test_hstu_training.py``.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import torch
import torch.nn.functional as functional
from torch import nn

from psrec.models.base import ModelInput, ModelStages
from psrec.models.hstu_attention import RelativeAttentionBias, dense_attention, jagged_attention
from psrec.models.jagged import GROUP_OVERHEAD, JaggedLayout, pack, unpack
from psrec.models.sasrec import (
    NegativesPer,
    candidate_logits,
    check_negatives_per,
    check_next_item_inputs,
    hit_ids,
    l2_normalize,
    negatives_logits,
    next_item_loss,
    target_state,
)
from psrec.models.transformer import Dropout

Loss = Literal["bce", "sampled_softmax"]
NORM_EPS = 1e-6
NUM_TIME_BUCKETS = 128  # the reference's


class HSTUEmbedding(nn.Module):
    """ModelInput -> {"hidden": (B, L, D), "mask": (B, L), ["times": (B, L + 1)], pass-through targets}."""

    def __init__(self, embedding_dim: int, *, max_length: int, dropout: float) -> None:
        super().__init__()
        self.max_length = max_length
        self.scale = math.sqrt(embedding_dim)
        self.positions = nn.Parameter(nn.init.xavier_normal_(torch.empty(max_length, embedding_dim)))
        self.dropout = Dropout(dropout)

    def forward(self, inp: ModelInput) -> dict[str, torch.Tensor]:
        if "seq" not in inp.sequences or "seq" not in inp.masks:
            raise ValueError('HSTU needs ModelInput.sequences["seq"] and masks["seq"]')
        sequence = inp.sequences["seq"]  # (B, L, D)
        if sequence.shape[1] > self.max_length:
            raise ValueError(
                f"HSTU was built for sequences up to {self.max_length} long, got {sequence.shape[1]}"
            )
        mask = inp.masks["seq"].bool()  # (B, L), real items right-aligned
        position = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): 0 = the oldest real item
        hidden = self.dropout(sequence * self.scale + self.positions[position])
        state = {"hidden": hidden * mask.unsqueeze(-1).to(hidden.dtype), "mask": mask}
        if "seq" in inp.timestamps:
            state["times"] = inp.timestamps["seq"]  # (B, L + 1) int64
        state.update(target_state(inp))
        return state


class HSTUBlock(nn.Module):
    """One HSTU layer; `forward` on packed tokens (T, D), `forward_dense` on the padded batch (B, L, D)."""

    def __init__(
        self,
        dim: int,
        *,
        max_length: int,
        num_heads: int,
        attention_dim: int,
        linear_dim: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.attention_dim = attention_dim
        self.linear_dim = linear_dim
        width = 2 * num_heads * (linear_dim + attention_dim)
        self.uvqk = nn.Parameter(torch.empty(dim, width).normal_(0.0, 0.02))  # (D, 2 H dv + 2 H dqk)
        self.output = nn.Linear(num_heads * linear_dim, dim)
        nn.init.xavier_uniform_(self.output.weight)
        self.bias = RelativeAttentionBias(max_length, num_buckets=NUM_TIME_BUCKETS)
        self.dropout = Dropout(dropout)
        self.scale = 1.0 / max_length

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(..., D) -> U (..., H dv), V (..., H, dv), Q (..., H, dqk), K (..., H, dqk)."""
        normed = functional.layer_norm(x, (self.dim,), eps=NORM_EPS)
        heads, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim
        u, v, q, k = functional.silu(normed @ self.uvqk).split(
            [heads * dv, heads * dv, heads * dqk, heads * dqk], -1
        )
        return u, v.unflatten(-1, (heads, dv)), q.unflatten(-1, (heads, dqk)), k.unflatten(-1, (heads, dqk))

    def _combine(self, x: torch.Tensor, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x + W_o Dropout(U * Norm(A V)): x (..., D), u (..., H dv), attended (..., H, dv)."""
        attended = attended.flatten(-2)
        gated = u * functional.layer_norm(attended, (attended.shape[-1],), eps=NORM_EPS)
        return x + self.output(self.dropout(gated))

    def forward(
        self, x: torch.Tensor, layout: JaggedLayout, times: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Packed tokens x (T, D) -> (T, D); `times` = (query times, key times), each (T,) int64."""
        u, v, q, k = self._projections(x)
        query_times, key_times = times if times is not None else (None, None)
        attended = jagged_attention(
            q, k, v, layout, scale=self.scale, bias=self.bias, query_times=query_times, key_times=key_times
        )  # (T, H, dv)
        return self._combine(x, u, attended)

    def forward_dense(
        self, x: torch.Tensor, mask: torch.Tensor, times: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The oracle: padded x (B, L, D), mask (B, L), times (B, L + 1) -> (B, L, D), zeros at padding."""
        u, v, q, k = self._projections(x)
        attended = dense_attention(q, k, v, mask, scale=self.scale, bias=self.bias, times=times)
        return self._combine(x, u, attended) * mask.unsqueeze(-1).to(x.dtype)


class HSTUStack(nn.Module):
    """HSTU blocks over ``{"hidden": (B, L, D), "mask": (B, L), ["times"]}``; returns it with "hidden" updated.

    ``jagged`` (default): pack once, run every block on the packed tokens, unpack once. Otherwise each
    block runs on the padded batch (the oracle).
    """

    def __init__(
        self, blocks: list[HSTUBlock], *, jagged: bool = True, group_overhead: int = GROUP_OVERHEAD
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.jagged = jagged
        self.group_overhead = group_overhead

    @property
    def hstu_blocks(self) -> list[HSTUBlock]:
        return cast(list[HSTUBlock], list(self.blocks))

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return run_blocks(self.hstu_blocks, state, jagged=self.jagged, group_overhead=self.group_overhead)

    def block_parts(self) -> list[nn.Module]:
        """One ``state -> state`` module per block; their chain equals `forward` (`psrec.models.base.BlockStack`)."""
        return [
            HSTUBlockOnState(block, jagged=self.jagged, group_overhead=self.group_overhead)
            for block in self.hstu_blocks
        ]


class HSTUBlockOnState(nn.Module):
    """One block of an `HSTUStack` on the state dict (packing and unpacking around it when jagged)."""

    def __init__(self, block: HSTUBlock, *, jagged: bool, group_overhead: int) -> None:
        super().__init__()
        self.block = block
        self.jagged = jagged
        self.group_overhead = group_overhead

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return run_blocks([self.block], state, jagged=self.jagged, group_overhead=self.group_overhead)


def run_blocks(
    blocks: list[HSTUBlock],
    state: dict[str, torch.Tensor],
    *,
    jagged: bool,
    group_overhead: int = GROUP_OVERHEAD,
) -> dict[str, torch.Tensor]:
    """The state after `blocks`: packed once around all of them (jagged), or each on the padded batch."""
    hidden, mask = state["hidden"], state["mask"]  # (B, L, D), (B, L)
    times = state.get("times")  # (B, L + 1) int64 or None
    if not jagged:
        for block in blocks:
            hidden = block.forward_dense(hidden, mask, times)
        return {**state, "hidden": hidden}
    layout = JaggedLayout.from_mask(mask, group_overhead=group_overhead)
    length = mask.shape[1]
    packed_times = None
    if times is not None:  # query time of position i: the next event's, times[:, i + 1]
        packed_times = (pack(times[:, 1 : length + 1], layout), pack(times[:, :length], layout))
    x = pack(hidden, layout)  # (T, D)
    for block in blocks:
        x = block(x, layout, packed_times)
    return {**state, "hidden": unpack(x, layout)}


class HSTUHead(nn.Module):
    """L2-normalised user states against L2-normalised items, divided by the temperature."""

    def __init__(self, *, temperature: float, negatives_per: NegativesPer = "user") -> None:
        super().__init__()
        self.temperature = temperature
        self.negatives_per = negatives_per

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = l2_normalize(state["hidden"])  # (B, L, D)
        scaled = hidden / self.temperature
        out = {"hidden": hidden}
        if "pos" in state:
            out["pos_logits"] = (scaled * l2_normalize(state["pos"])).sum(-1)  # (B, L)
        if "neg" in state:
            out["neg_logits"] = (scaled * l2_normalize(state["neg"])).sum(-1)  # (B, L)
        if "negatives" in state:
            negatives = l2_normalize(state["negatives"])  # (B, N, D)
            out["negatives_logits"] = negatives_logits(  # (B, L, N)
                scaled, negatives, self.negatives_per, hit_ids(state), state.get("mask")
            )
        if "candidates" in state:
            out["candidate_logits"] = candidate_logits(scaled, l2_normalize(state["candidates"]))
        return out


class HSTU(nn.Module):
    uses_linear_terms = False

    def __init__(
        self,
        embedding_dim: int,
        *,
        max_length: int = 200,
        num_blocks: int = 2,
        num_heads: int = 1,
        attention_dim: int = 50,
        linear_dim: int = 50,
        dropout: float = 0.2,
        temperature: float = 0.05,
        loss: Loss = "sampled_softmax",
        negatives_per: NegativesPer = "user",
        jagged: bool = True,
    ) -> None:
        super().__init__()
        if loss not in ("bce", "sampled_softmax"):
            raise ValueError(f"HSTU loss must be 'bce' or 'sampled_softmax', not {loss!r}")
        check_negatives_per(negatives_per)
        if temperature <= 0:
            raise ValueError(f"HSTU temperature must be > 0, got {temperature}")
        self.loss_name = loss
        self.embedding = HSTUEmbedding(embedding_dim, max_length=max_length, dropout=dropout)
        block_sizes = dict(num_heads=num_heads, attention_dim=attention_dim, linear_dim=linear_dim)
        self.blocks = HSTUStack(
            [
                HSTUBlock(embedding_dim, max_length=max_length, dropout=dropout, **block_sizes)
                for _ in range(num_blocks)
            ],
            jagged=jagged,
        )
        self.head = HSTUHead(temperature=temperature, negatives_per=negatives_per)

    def stages(self) -> ModelStages:
        return ModelStages(self.embedding, self.blocks, self.head)

    def run(self, inp: ModelInput) -> dict[str, torch.Tensor]:
        """All head outputs for the given inputs: the composition of the three stages."""
        return self.head(self.blocks(self.embedding(inp)))

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Candidate logits (B, C) (or (B, N) for shared candidates) from the last position."""
        if "candidates" not in inp.sequences:
            raise ValueError('HSTU.forward scores ModelInput.sequences["candidates"]; none given')
        return self.run(inp)["candidate_logits"]

    def loss(self, inp: ModelInput, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss over real positions, (B, 2) [pos, a negative] logits at the last position).

        `labels` is ignored: the targets are the next items ("pos") and sampled negatives
        ("negatives" for the sampled softmax, "neg" for BCE; see the module docstring).
        """
        check_next_item_inputs(inp, self.loss_name, "HSTU")
        return next_item_loss(self.run(inp), inp, self.loss_name)

    def predict(self, inp: ModelInput) -> torch.Tensor:
        return self(inp)
