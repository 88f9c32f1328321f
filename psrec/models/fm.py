"""Factorization machine (Rendle 2010): first-order terms plus all pairwise embedding dot products.

Math (B = batch, F = sparse features, D = embedding dim):

    v = [pooled (B, F, D), x_j * u_j for each dense feature j]        # (B, F + num_dense, D)
    logit = b + sum_f w_f + sum_j a_j x_j + 0.5 * sum_d((sum_i v_id)^2 - sum_i v_id^2)   # (B,)

``w_f`` are the first-order weights pulled from the dim-1 companion table (``ModelInput.linear``).
"""

from __future__ import annotations

import torch

from psrec.models.base import ClickThroughRateModel, ModelInput, require_linear
from psrec.models.layers import DenseEmbedding, FactorizationMachine
from psrec.models.lr import LinearTerms


class FactorizationMachineModel(ClickThroughRateModel):
    uses_linear_terms = True

    def __init__(self, num_dense: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear_terms = LinearTerms(num_dense)
        self.dense_embedding = DenseEmbedding(num_dense, embedding_dim) if num_dense else None
        self.interaction = FactorizationMachine()

    def forward(self, inp: ModelInput) -> torch.Tensor:
        return self.linear_terms(require_linear(inp, "FM"), inp.dense) + self.interaction(
            fm_vectors(inp, self.dense_embedding)
        )


def fm_vectors(inp: ModelInput, dense_embedding: DenseEmbedding | None) -> torch.Tensor:
    """The vectors an FM interacts: pooled (B, F, D), plus embedded dense features when there are any."""
    if dense_embedding is None:
        return inp.pooled
    return torch.cat([inp.pooled, dense_embedding(inp.dense)], dim=1)  # (B, F + num_dense, D)
