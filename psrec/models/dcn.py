"""DCN-v2 (Wang et al. 2021), stacked or parallel, full-rank or low-rank cross layers.

Math (B = batch, F = sparse features, D = embedding dim, d = F D + num_dense):

    x0 = [flatten(pooled), dense]                          # (B, d)
    cross = CrossNetwork(x0)   # x_{l+1} = x0 * (W_l x_l + b_l) + x_l, W_l = U_l V_l^T when low-rank
    structure "crossnet_only":   h = cross
              "stacked":         h = MLP(cross)
              "parallel":        h = [cross, MLP(x0)]
              "stacked_parallel": h = [MLP_s(cross), MLP_p(x0)]
    logit = Linear(h) -> (B,)

As FuxiCTR's DCNv2, so BARS hyper-parameters carry over (Frappe: 4 cross layers, parallel, dropout 0.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from psrec.models.base import ClickThroughRateModel, ModelInput
from psrec.models.layers import MLP, CrossNetwork, flatten_features

Structure = Literal["crossnet_only", "stacked", "parallel", "stacked_parallel"]


class DCNv2(ClickThroughRateModel):
    uses_linear_terms = False

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        *,
        structure: Structure = "parallel",
        num_cross_layers: int = 4,
        low_rank: int | None = None,
        hidden_sizes: Sequence[int] = (400, 400, 400),
        activation: str = "relu",
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        input_dim = num_sparse * embedding_dim + num_dense
        self.structure = structure
        self.cross = CrossNetwork(input_dim, num_cross_layers, low_rank=low_rank)

        def mlp() -> MLP:
            return MLP(input_dim, hidden_sizes, activation=activation, batch_norm=batch_norm, dropout=dropout)

        self.stacked = mlp() if structure in ("stacked", "stacked_parallel") else None
        self.parallel = mlp() if structure in ("parallel", "stacked_parallel") else None
        head_dim = {
            "crossnet_only": input_dim,
            "stacked": hidden_sizes[-1],
            "parallel": input_dim + hidden_sizes[-1],
            "stacked_parallel": 2 * hidden_sizes[-1],
        }[structure]
        self.output = nn.Linear(head_dim, 1)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        x0 = flatten_features(inp.pooled, inp.dense)  # (B, d)
        cross = self.cross(x0)  # (B, d)
        parts = [self.stacked(cross) if self.stacked is not None else cross]
        if self.parallel is not None:
            parts.append(self.parallel(x0))
        return self.output(torch.cat(parts, dim=1)).squeeze(-1)  # (B,)
