"""Helpers shared by the model tests: tiny `ModelInput`s and a gradient check.

Imported as a top-level module (pytest puts this folder on sys.path); named uniquely for that reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from psrec.models.base import ModelInput
from psrec.trainer.metrics import auc

BATCH, NUM_DENSE, NUM_SPARSE, DIM = 4, 3, 5, 8


def tiny_input(
    *,
    batch: int = BATCH,
    num_dense: int = NUM_DENSE,
    num_sparse: int = NUM_SPARSE,
    dim: int = DIM,
    linear: bool = False,
    seed: int = 0,
) -> ModelInput:
    generator = torch.Generator().manual_seed(seed)
    return ModelInput(
        dense=torch.randn(batch, num_dense, generator=generator),
        pooled=torch.randn(batch, num_sparse, dim, generator=generator).requires_grad_(),
        linear=torch.randn(batch, num_sparse, generator=generator).requires_grad_() if linear else None,
    )


def assert_gradients_reach(model: nn.Module, loss: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Backward `loss` and check every parameter and every given input got a nonzero gradient."""
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"no gradient for parameter {name}"
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, f"zero gradient for parameter {name}"
    for tensor in inputs:
        assert tensor.grad is not None and tensor.grad.abs().sum() > 0


def synthetic_ctr_data(num_samples: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids (N, 3) over a vocabulary of 16, dense (N, 2) and labels whose logit has an additive part
    (features 0 and 2) and a pure interaction between features 0 and 1 (sign[id0] * sign[id1])."""
    generator = torch.Generator().manual_seed(seed)
    table_generator = torch.Generator().manual_seed(1234)  # the same ground truth for every split
    additive = torch.randn(2, 16, generator=table_generator)
    sign = torch.randint(0, 2, (2, 16), generator=table_generator).float() * 2 - 1
    ids = torch.randint(0, 16, (num_samples, 3), generator=generator)
    dense = torch.randn(num_samples, 2, generator=generator)
    logit = additive[0, ids[:, 0]] + additive[1, ids[:, 2]] + 3 * sign[0, ids[:, 0]] * sign[1, ids[:, 1]]
    logit = logit + 0.5 * dense[:, 0]
    labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
    return ids, dense, labels


class StandInTables(nn.Module):
    """Plain embedding parameters standing in for the parameter server: (3 features, 16 ids, dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embeddings = nn.Parameter(torch.randn(3, 16, dim) * 0.01)
        self.linear = nn.Parameter(torch.zeros(3, 16))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> ModelInput:
        features = torch.arange(3)
        return ModelInput(
            dense=dense,
            pooled=self.embeddings[features, ids],  # (B, 3, D)
            linear=self.linear[features, ids],  # (B, 3)
        )


def train_and_evaluate_auc(
    make_model: Callable[[], nn.Module], *, dim: int, steps: int = 250, seed: int = 0
) -> float:
    """Train a fresh model with stand-in tables on synthetic data; return the held-out AUC."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only contend on a loaded box
    try:
        return _train_and_evaluate_auc(make_model, dim=dim, steps=steps, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _train_and_evaluate_auc(make_model: Callable[[], nn.Module], *, dim: int, steps: int, seed: int) -> float:
    torch.manual_seed(seed)
    model = make_model()
    tables = StandInTables(dim)
    ids, dense, labels = synthetic_ctr_data(steps * 128, seed=seed)
    optimizer = torch.optim.Adam([*model.parameters(), *tables.parameters()], lr=0.01)
    model.train()
    for step in range(steps):
        rows = slice(step * 128, (step + 1) * 128)
        loss, _ = model.loss(tables(ids[rows], dense[rows]), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    test_ids, test_dense, test_labels = synthetic_ctr_data(4000, seed=seed + 1)
    model.eval()
    with torch.no_grad():
        scores = model.predict(tables(test_ids, test_dense))
    return auc(test_labels, scores)
