"""`DenseOptimizer` against torch.optim (the oracle): the same parameters after every step, the same
state_dict, state_dicts that load across the two, and no import of torch's compiler."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch

from psrec.trainer.dense_optimizer import DenseOptimizer

CASES = [
    ("adam", {"betas": (0.9, 0.99), "weight_decay": 0.0}),
    ("adam", {"betas": (0.8, 0.999), "weight_decay": 0.01}),
    ("adagrad", {"weight_decay": 0.0}),
    ("adagrad", {"weight_decay": 0.02}),
    ("sgd", {"weight_decay": 0.0}),
    ("sgd", {"weight_decay": 0.05}),
]


def _torch_optimizer(name: str, params: Any, lr: float, settings: dict[str, Any]) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=settings["betas"], weight_decay=settings["weight_decay"])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=settings["weight_decay"])
    return torch.optim.SGD(params, lr=lr, weight_decay=settings["weight_decay"])


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, optimizer: Any, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=generator)
        y = torch.randn(16, 1, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def _assert_same_state_dict(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert a["state"][index].keys() == b["state"][index].keys()
        for key, value in a["state"][index].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])), (index, key)


@pytest.mark.parametrize(("name", "settings"), CASES)
def test_steps_and_state_match_torch_optim(name: str, settings: dict[str, Any]) -> None:
    ours, theirs = _model(), _model()
    optimizer = DenseOptimizer(ours.parameters(), name, lr=0.05, **settings)
    reference = _torch_optimizer(name, theirs.parameters(), 0.05, settings)
    _assert_same_state_dict(optimizer.state_dict(), reference.state_dict())
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 1, generator=generator)
        for model, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        _assert_same_parameters(ours, theirs)
    _assert_same_state_dict(optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize(("name", "settings"), CASES[::2])
def test_state_dicts_load_across_torch_optim(name: str, settings: dict[str, Any]) -> None:
    """A checkpoint written by torch.optim resumes in DenseOptimizer and the other way round, with
    the learning rate the run had lowered (early stopping's lr_decay) carried along."""
    trained = _model()
    source = _torch_optimizer(name, trained.parameters(), 0.05, settings)
    _train(trained, source, steps=3, seed=2)
    for group in source.param_groups:
        group["lr"] *= 0.5

    resumed, reference_model = _model(5), _model(5)
    resumed.load_state_dict(trained.state_dict())
    reference_model.load_state_dict(trained.state_dict())
    ours = DenseOptimizer(resumed.parameters(), name, lr=0.05, **settings)
    ours.load_state_dict(source.state_dict())
    assert ours.param_groups[0]["lr"] == 0.025
    reference = _torch_optimizer(name, reference_model.parameters(), 0.05, settings)
    reference.load_state_dict(copy.deepcopy(source.state_dict()))
    _train(resumed, ours, steps=3, seed=3)
    _train(reference_model, reference, steps=3, seed=3)
    _assert_same_parameters(resumed, reference_model)

    back_model = _model(7)
    back_model.load_state_dict(resumed.state_dict())
    back = _torch_optimizer(name, back_model.parameters(), 0.05, settings)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch.optim keeps the loaded tensors
    _train(back_model, back, steps=2, seed=4)
    _train(resumed, ours, steps=2, seed=4)
    _assert_same_parameters(resumed, back_model)


def test_loading_copies_the_state() -> None:
    """Stepping after a load leaves the loaded dict as it was (a snapshot can be restored twice)."""
    model = _model()
    optimizer = DenseOptimizer(model.parameters(), "adam", lr=0.01)
    _train(model, optimizer, steps=2, seed=0)
    snapshot = {
        "state": {
            i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
        },
        "param_groups": optimizer.state_dict()["param_groups"],
    }
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in snapshot["state"].items()}
    optimizer.load_state_dict(snapshot)
    _train(model, optimizer, steps=2, seed=1)
    for i, values in before.items():
        for key, value in values.items():
            assert torch.equal(snapshot["state"][i][key], value)


def test_a_state_dict_of_another_shape_or_setting_is_refused() -> None:
    optimizer = DenseOptimizer(_model().parameters(), "adam", lr=0.01)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="groups of"):
        optimizer.load_state_dict(torch.optim.Adam(other.parameters()).state_dict())
    amsgrad = torch.optim.Adam(_model().parameters(), amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="must be one of"):
        DenseOptimizer(_model().parameters(), "rmsprop", lr=0.01)


def test_building_and_stepping_do_not_import_the_compiler() -> None:
    code = (
        "import sys, torch\n"
        "from psrec.trainer.dense_optimizer import DenseOptimizer\n"
        "for name in ('adam', 'adagrad', 'sgd'):\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    optimizer = DenseOptimizer(model.parameters(), name, lr=0.1)\n"
        "    model(torch.ones(2, 4)).sum().backward()\n"
        "    optimizer.step(); optimizer.zero_grad(); optimizer.load_state_dict(optimizer.state_dict())\n"
        "assert 'torch._dynamo' not in sys.modules, 'the dense optimizer imported torch._dynamo'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
