"""Logistic regression (LR) over the first-order weights the trainer pulls.

Math (B = batch, F = sparse features): ``logit = b + sum_f w_f + sum_j u_j x_j``, where ``w_f`` is the
(B, F) pooled weight from the dim-1 companion table (``ModelInput.linear``), ``b`` a learned bias and
``u`` a learned weight per dense feature x_j (only when there are dense features).
"""

from __future__ import annotations

import torch
from torch import nn

from psrec.models.base import ClickThroughRateModel, ModelInput, require_linear


class LinearTerms(nn.Module):
    """The first-order part shared by LR, FM, Wide&Deep and DeepFM: (B, F) weights + dense -> (B,)."""

    def __init__(self, num_dense: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))
        self.dense = nn.Linear(num_dense, 1, bias=False) if num_dense else None

    def forward(self, linear: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        logit = linear.sum(dim=1) + self.bias  # (B,)
        if self.dense is not None:
            logit = logit + self.dense(dense).squeeze(-1)
        return logit


class LogisticRegression(ClickThroughRateModel):
    uses_linear_terms = True

    def __init__(self, num_dense: int) -> None:
        super().__init__()
        self.linear_terms = LinearTerms(num_dense)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        return self.linear_terms(require_linear(inp, "LogisticRegression"), inp.dense)  # (B,)
