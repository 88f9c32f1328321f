"""Each CTR model learns a synthetic task whose labels hinge on a feature interaction.

Plain nn.Parameter tables stand in for the parameter server. The Bayes-optimal held-out AUC is about
0.96; LR, which cannot represent the interaction, reaches about 0.61.
"""

from collections.abc import Callable

import pytest
from model_testing import train_and_evaluate_auc
from torch import nn

from psrec.models import DLRM, DCNv2, DeepFM, FactorizationMachineModel, LogisticRegression, WideAndDeep

DIM = 8
HIDDEN = [32, 32]

CASES: dict[str, tuple[Callable[[], nn.Module], float]] = {
    "lr": (lambda: LogisticRegression(2), 0.58),
    "fm": (lambda: FactorizationMachineModel(2, DIM), 0.9),
    "wide_deep": (lambda: WideAndDeep(2, 3, DIM, hidden_sizes=HIDDEN), 0.9),
    "deepfm": (lambda: DeepFM(2, 3, DIM, hidden_sizes=HIDDEN), 0.9),
    "dcn_v2_parallel": (lambda: DCNv2(2, 3, DIM, hidden_sizes=HIDDEN, dropout=0.1), 0.9),
    "dcn_v2_stacked_low_rank": (
        lambda: DCNv2(2, 3, DIM, structure="stacked", low_rank=4, hidden_sizes=HIDDEN),
        0.9,
    ),
    "dlrm": (lambda: DLRM(2, 3, DIM, bottom_hidden_sizes=[8], top_hidden_sizes=HIDDEN), 0.9),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ctr_model_learns_interaction(name: str) -> None:
    make_model, minimum_auc = CASES[name]
    result = train_and_evaluate_auc(make_model, dim=DIM)
    assert result > minimum_auc, f"{name}: held-out AUC {result:.3f} <= {minimum_auc}"
