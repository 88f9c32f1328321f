"""Forward/backward of every CTR model on tiny shapes, with and without dense features."""

from collections.abc import Callable

import pytest
import torch
from model_testing import DIM, NUM_SPARSE, assert_gradients_reach, tiny_input
from torch import nn

from psrec.models import DCNv2, DeepFM, FactorizationMachineModel, LogisticRegression, WideAndDeep
from psrec.models.base import ClickThroughRateModel

FACTORIES: dict[str, Callable[[int], ClickThroughRateModel]] = {
    "lr": lambda num_dense: LogisticRegression(num_dense),
    "fm": lambda num_dense: FactorizationMachineModel(num_dense, DIM),
    "wide_deep": lambda num_dense: WideAndDeep(num_dense, NUM_SPARSE, DIM, hidden_sizes=[6, 5], dropout=0.1),
    "deepfm": lambda num_dense: DeepFM(num_dense, NUM_SPARSE, DIM, hidden_sizes=[6, 5]),
    "dcn_parallel": lambda num_dense: DCNv2(num_dense, NUM_SPARSE, DIM, hidden_sizes=[6], dropout=0.4),
    "dcn_stacked_low_rank": lambda num_dense: DCNv2(
        num_dense, NUM_SPARSE, DIM, structure="stacked", low_rank=3, hidden_sizes=[6], batch_norm=True
    ),
    "dcn_stacked_parallel": lambda num_dense: DCNv2(
        num_dense, NUM_SPARSE, DIM, structure="stacked_parallel", num_cross_layers=2, hidden_sizes=[6]
    ),
    "dcn_crossnet_only": lambda num_dense: DCNv2(num_dense, NUM_SPARSE, DIM, structure="crossnet_only"),
}


@pytest.mark.parametrize("num_dense", [0, 3])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_forward_backward(name: str, num_dense: int) -> None:
    torch.manual_seed(0)
    model = FACTORIES[name](num_dense)
    inp = tiny_input(num_dense=num_dense, linear=model.uses_linear_terms)
    assert model(inp).shape == (4,)
    loss, scores = model.loss(inp, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert loss.ndim == 0 and scores.shape == (4,) and not scores.requires_grad
    inputs = [tensor for tensor in (inp.pooled, inp.linear) if tensor is not None]
    if name == "lr":
        inputs = [inp.linear]  # LR reads only the first-order weights
    assert_gradients_reach(model, loss, inputs)


def test_models_that_need_linear_terms_say_so() -> None:
    with pytest.raises(ValueError, match="linear"):
        DeepFM(0, NUM_SPARSE, DIM)(tiny_input(num_dense=0))
    assert [FACTORIES[name](0).uses_linear_terms for name in ("lr", "fm", "wide_deep", "deepfm")] == [
        True
    ] * 4
    assert not DCNv2.uses_linear_terms


def test_lr_and_fm_match_formulas() -> None:
    inp = tiny_input(linear=True)
    lr = LogisticRegression(3)
    with torch.no_grad():
        lr.linear_terms.bias.fill_(0.5)
    expected_linear = inp.linear.sum(1) + 0.5 + lr.linear_terms.dense(inp.dense).squeeze(-1)
    torch.testing.assert_close(lr(inp), expected_linear)
    fm = FactorizationMachineModel(0, DIM)
    inp = tiny_input(num_dense=0, linear=True)
    vectors = inp.pooled
    pairs = sum(
        (vectors[:, i] * vectors[:, j]).sum(-1) for i in range(NUM_SPARSE) for j in range(i + 1, NUM_SPARSE)
    )
    torch.testing.assert_close(fm(inp), inp.linear.sum(1) + pairs)


def test_predict_returns_probabilities_in_eval() -> None:
    model = DeepFM(3, NUM_SPARSE, DIM, hidden_sizes=[6])
    model.eval()
    with torch.no_grad():
        probabilities = model.predict(tiny_input(linear=True))
    assert ((probabilities > 0) & (probabilities < 1)).all()
    assert isinstance(model, nn.Module)
