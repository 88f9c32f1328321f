"""DLRM (Naumov et al. 2019): bottom MLP on dense features, dot interaction, top MLP.

Math (B = batch, F = sparse features, D = embedding dim):

    b = BottomMLP(dense)                      # (B, D), last bottom size == D, activation on every layer
    z = [b, upper_triangle([b, e_1..e_F] [b, e_1..e_F]^T)]   # (B, D + (F + 1) F / 2)
    logit = TopMLP(z)                         # (B,)

Without dense features (Frappe) there is no bottom MLP and ``z`` is the upper triangle of the F
pooled embeddings' dot products alone, as FuxiCTR's DLRM does, so BARS hyper-parameters carry over.

``interaction="cat"`` (FuxiCTR's ``interaction_op: cat``, the setting BARS selected for Frappe)
replaces the dot products by the concatenation ``z = [b, e_1, ..., e_F]`` of shape (B, (F [+ 1]) D).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from psrec.models.base import ClickThroughRateModel, ModelInput
from psrec.models.layers import MLP, DotInteraction


class DLRM(ClickThroughRateModel):
    uses_linear_terms = False
    # Under bf16 autocast the pooled rows may come in bf16: they go straight into the interaction's
    # concatenation and bmm (or linear layer), which autocast runs in bf16 anyway.
    accepts_bf16_rows = True

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        *,
        bottom_hidden_sizes: Sequence[int] = (64,),
        top_hidden_sizes: Sequence[int] = (400, 400, 400),
        activation: str = "relu",
        batch_norm: bool = False,
        dropout: float = 0.0,
        interaction: str = "dot",
    ) -> None:
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"DLRM interaction must be 'dot' or 'cat', got {interaction!r}")
        self.bottom = (
            MLP(num_dense, [*bottom_hidden_sizes, embedding_dim], activation=activation)
            if num_dense
            else None
        )
        self.interaction = (
            DotInteraction(num_sparse, embedding_dim, has_bottom=self.bottom is not None)
            if interaction == "dot"
            else ConcatInteraction(num_sparse, embedding_dim, has_bottom=self.bottom is not None)
        )
        self.top = MLP(
            self.interaction.output_dim,
            top_hidden_sizes,
            output_dim=1,
            activation=activation,
            batch_norm=batch_norm,
            dropout=dropout,
        )

    def forward(self, inp: ModelInput) -> torch.Tensor:
        bottom = self.bottom(inp.dense) if self.bottom is not None else None  # (B, D) | None
        interaction = self.interaction(bottom, inp.pooled)  # (B, [D +] N (N - 1) / 2) | (B, (F [+ 1]) D)
        return self.top(interaction).squeeze(-1)  # (B,)


class ConcatInteraction(nn.Module):
    """(bottom (B, D) | None, pooled (B, F, D)) -> (B, (F [+ 1]) D): the vectors side by side."""

    def __init__(self, num_sparse: int, embedding_dim: int, *, has_bottom: bool) -> None:
        super().__init__()
        self.output_dim = (num_sparse + int(has_bottom)) * embedding_dim

    def forward(self, bottom: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        flat = pooled.flatten(1)
        return flat if bottom is None else torch.cat([bottom, flat], dim=1)
