"""The dense part's optimizer: Adam, Adagrad or SGD, as ``torch.optim`` computes them, without
importing torch's compiler.

Every ``torch.optim.Optimizer`` imports ``torch._dynamo`` when it is built and when it first steps
(its methods are wrapped by ``torch._disable_dynamo``): about 0.6 s of a trainer's start-up
(docs/benchmarks.md, "Start-up"). `DenseOptimizer` calls torch's own functional updates
(``torch.optim.adam.adam``, ``torch.optim.adagrad.adagrad``, ``torch.optim.sgd.sgd``, which import
nothing more outside ``torch.compile``) with the arguments ``torch.optim.Adam`` / ``Adagrad`` / ``SGD``
pass them, and keeps their ``param_groups``, ``state`` and ``state_dict`` layout: the parameters
after each step are identical to torch's, and a ``state_dict`` of either loads into the other
(checkpoints written with ``torch.optim`` load; tests/trainer/test_dense_optimizer.py is the oracle).

Only what psrec's ``training.dense_optimizer`` configures is supported: one parameter group, dense
gradients, no AMSGrad, momentum, Nesterov or fused kernels.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd

_CLASSES = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
NAMES = tuple(_CLASSES)


def _defaults(name: str, lr: float, betas: tuple[float, float], weight_decay: float) -> dict[str, Any]:
    """The group hyperparameters torch.optim's class of `name` records: its constructor's defaults
    (read from its signature, so they follow the installed torch) with `lr`, `weight_decay` and,
    for Adam, `betas`."""
    if name not in _CLASSES:
        raise ValueError(f"dense optimizer must be one of {NAMES}, not {name!r}")
    parameters = inspect.signature(_CLASSES[name]).parameters
    group = {key: p.default for key, p in parameters.items() if key != "params"}
    group.update(lr=lr, weight_decay=weight_decay)
    if name == "adam":
        group["betas"] = betas
    return group


# settings DenseOptimizer does not implement: a loaded state_dict asking for them is refused
_UNSUPPORTED = {
    "amsgrad": False,
    "capturable": False,
    "differentiable": False,
    "momentum": 0,
    "nesterov": False,
}


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps a CPU ``step`` count in."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class DenseOptimizer:
    """``torch.optim.Adam`` / ``Adagrad`` / ``SGD`` over `params` (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        name: str,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"dense optimizer: invalid lr {lr}, betas {betas} or weight_decay {weight_decay}"
            )
        self.name = name
        self.defaults = _defaults(name, float(lr), (float(betas[0]), float(betas[1])), float(weight_decay))
        parameters = list(params)
        if len({id(p) for p in parameters}) != len(parameters):
            raise ValueError("dense optimizer: a parameter appears twice")
        self.param_groups: list[dict[str, Any]] = [{**self.defaults, "params": parameters}]
        self.state: collections.defaultdict[torch.Tensor, dict[str, Any]] = collections.defaultdict(dict)
        if name == "adagrad":  # torch.optim.Adagrad builds its state up front
            for p in parameters:
                self.state[p] = self._initial_state(p, self.param_groups[0])

    def _initial_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        step = torch.tensor(0.0, dtype=_scalar_dtype())
        if self.name == "adam":
            zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
            return {"step": step, "exp_avg": zeros, "exp_avg_sq": torch.zeros_like(zeros)}
        if self.name == "adagrad":
            total = torch.full_like(
                p, group["initial_accumulator_value"], memory_format=torch.preserve_format
            )
            return {"step": step, "sum": total}
        return {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("dense optimizer: sparse gradients are not supported")
            has_complex = any(torch.is_complex(p) for p in params)
            states = []
            for p in params:
                if not self.state[p]:
                    self.state[p] = self._initial_state(p, group)
                states.append(self.state[p])
            if self.name == "adam":
                beta1, beta2 = group["betas"]
                adam(
                    params,
                    grads,
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [],
                    [s["step"] for s in states],
                    amsgrad=False,
                    has_complex=has_complex,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                    foreach=group["foreach"],
                    capturable=False,
                    differentiable=False,
                    fused=group["fused"],
                    grad_scale=None,
                    found_inf=None,
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                )
            elif self.name == "adagrad":
                adagrad(
                    params,
                    grads,
                    [s["sum"] for s in states],
                    [s["step"] for s in states],
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    lr_decay=group["lr_decay"],
                    eps=group["eps"],
                    has_sparse_grad=False,
                    foreach=group["foreach"],
                    maximize=group["maximize"],
                    differentiable=False,
                    has_complex=has_complex,
                    fused=group["fused"],
                    grad_scale=None,
                    found_inf=None,
                )
            else:
                sgd(
                    params,
                    grads,
                    [None] * len(params),
                    weight_decay=group["weight_decay"],
                    momentum=0,
                    lr=group["lr"],
                    dampening=group["dampening"],
                    nesterov=False,
                    maximize=group["maximize"],
                    has_sparse_grad=False,
                    foreach=group["foreach"],
                    fused=group["fused"],
                    grad_scale=None,
                    found_inf=None,
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: parameters by their index across the groups (tensors not copied)."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(value) for p, value in self.state.items() if value}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the groups' hyperparameters and the state of `state_dict` (this class's or a
        torch.optim optimizer's of the same kind); the tensors are copied to each parameter's dtype
        and device."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)
        ):
            raise ValueError(
                "dense optimizer: the loaded state has groups of "
                f"{[len(s['params']) for s in saved]} parameters, this model {[len(g['params']) for g in self.param_groups]}"
            )
        for group in saved:
            for key, allowed in _UNSUPPORTED.items():
                if group.get(key, allowed) != allowed:
                    raise ValueError(
                        f"dense optimizer: the loaded state sets {key}={group[key]!r}, not supported"
                    )
        by_index = {
            i: p
            for s, g in zip(saved, self.param_groups, strict=True)
            for i, p in zip(s["params"], g["params"], strict=True)
        }
        state: collections.defaultdict[torch.Tensor, dict[str, Any]] = collections.defaultdict(dict)
        for i, values in state_dict["state"].items():
            p = by_index[i]
            entry = {}
            for key, value in values.items():
                if key == "step":
                    entry[key] = torch.tensor(float(value), dtype=_scalar_dtype())
                elif torch.is_tensor(value):
                    dtype = p.dtype if p.is_floating_point() else value.dtype
                    entry[key] = value.to(device=p.device, dtype=dtype, copy=True)
                else:
                    entry[key] = value
            state[p] = entry
        self.param_groups = [
            {**self.defaults, **{k: v for k, v in s.items() if k != "params"}, "params": g["params"]}
            for s, g in zip(saved, self.param_groups, strict=True)
        ]
        self.state = state

    def __repr__(self) -> str:
        settings = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return f"DenseOptimizer({self.name}, {settings})"
