"""DeepFM (Guo et al. 2017), as FuxiCTR/BARS build it: an FM and an MLP over the same embeddings.

Math (B = batch, F = sparse features, D = embedding dim):

    fm = b + sum_f w_f + sum_j a_j x_j + 0.5 * sum_d((sum_i v_id)^2 - sum_i v_id^2)   # (B,)
    deep = MLP([flatten(pooled), dense]) -> 1                                          # (B,)
    logit = fm + deep

``w_f`` come from the dim-1 companion table (``ModelInput.linear``); ``v`` are the pooled embeddings
plus ``x_j * u_j`` for dense features. BARS Frappe: D = 10, MLP 400x3, batch norm, dropout 0.2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psrec.models.base import ClickThroughRateModel, ModelInput, require_linear
from psrec.models.fm import fm_vectors
from psrec.models.layers import MLP, DenseEmbedding, FactorizationMachine, flatten_features
from psrec.models.lr import LinearTerms


class DeepFM(ClickThroughRateModel):
    uses_linear_terms = True

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        *,
        hidden_sizes: Sequence[int] = (400, 400, 400),
        activation: str = "relu",
        batch_norm: bool = True,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.linear_terms = LinearTerms(num_dense)
        self.dense_embedding = DenseEmbedding(num_dense, embedding_dim) if num_dense else None
        self.interaction = FactorizationMachine()
        self.deep = MLP(
            num_sparse * embedding_dim + num_dense,
            hidden_sizes,
            output_dim=1,
            activation=activation,
            batch_norm=batch_norm,
            dropout=dropout,
        )

    def forward(self, inp: ModelInput) -> torch.Tensor:
        first_order = self.linear_terms(require_linear(inp, "DeepFM"), inp.dense)  # (B,)
        second_order = self.interaction(fm_vectors(inp, self.dense_embedding))  # (B,)
        deep = self.deep(flatten_features(inp.pooled, inp.dense)).squeeze(-1)  # (B,)
        return first_order + second_order + deep
