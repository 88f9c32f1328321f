"""Wide & Deep (Cheng et al. 2016), as FuxiCTR/BARS build it.

Math (B = batch, F = sparse features, D = embedding dim):

    wide = b + sum_f w_f + sum_j a_j x_j                  # first-order (ModelInput.linear), (B,)
    deep = MLP([flatten(pooled), dense]) -> 1             # (B, F D + num_dense) -> (B,)
    logit = wide + deep
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psrec.models.base import ClickThroughRateModel, ModelInput, require_linear
from psrec.models.layers import MLP, flatten_features
from psrec.models.lr import LinearTerms


class WideAndDeep(ClickThroughRateModel):
    uses_linear_terms = True

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        *,
        hidden_sizes: Sequence[int] = (400, 400, 400),
        activation: str = "relu",
        batch_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.wide = LinearTerms(num_dense)
        self.deep = MLP(
            num_sparse * embedding_dim + num_dense,
            hidden_sizes,
            output_dim=1,
            activation=activation,
            batch_norm=batch_norm,
            dropout=dropout,
        )

    def forward(self, inp: ModelInput) -> torch.Tensor:
        wide = self.wide(require_linear(inp, "WideAndDeep"), inp.dense)  # (B,)
        deep = self.deep(flatten_features(inp.pooled, inp.dense)).squeeze(-1)  # (B,)
        return wide + deep
