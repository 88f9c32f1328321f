"""fp32 Linear (+ ReLU) on CPU through oneDNN: the MLPs' forward and input-gradient GEMMs.

PyTorch's CPU ``nn.Linear`` calls MKL's sgemm. oneDNN's matmul, which PyTorch ships and
`torch.compile` uses for CPU linears (``torch.ops.mkldnn._linear_pointwise``, a ReLU fused into
it), ran the bench DLRM's MLP layers on the AMD EPYC VM (Zen 4, AVX-512; batch 4096, one thread)
in 39 ms against MKL's 47-55 ms forward, and their input gradients in 39 against 53 ms.

`linear`, and the `Linear` module the MLPs are built of, take that path for fp32 CPU tensors
outside autocast, `torch.compile` (which picks its own kernels) and `torch.export`; PyTorch's
everywhere else. The backward: the ReLU mask from the saved output, the input gradient through
oneDNN, the weight gradient ``grad^T x`` and the bias gradient as PyTorch computes them. The two
paths are the same sums in another order: results agree to fp32 rounding, not bit for bit
(tests/models/test_onednn_linear.py: against ``nn.Linear``, tolerance from the sum's length).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn


def _onednn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> torch.Tensor:
    result: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation, [], "")
    return result


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool
    ) -> torch.Tensor:
        out = _onednn(x, weight, bias, "relu" if relu else "none")
        ctx.relu = relu
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, out if relu else None)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, out = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, out, 0)
        grad = grad.contiguous()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t().contiguous(), None, "none")
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias, None


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes oneDNN's path for these tensors (module docstring)."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()  # an exported program holds PyTorch's own ops
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, relu: bool = False
) -> torch.Tensor:
    """``relu(x @ weight.T + bias)`` (or without the ReLU): x (B, in), weight (out, in) -> (B, out)."""
    if uses_onednn(x, weight):
        result: torch.Tensor = _OneDNNLinear.apply(x.contiguous(), weight, bias, relu)
        return result
    out = functional.linear(x, weight, bias)
    return functional.relu(out) if relu else out


class Linear(nn.Linear):
    """``nn.Linear`` through `linear`, with the following ReLU fused when ``relu`` (the same state dict
    and hooks as ``nn.Linear``; a ReLU applied after it again changes nothing)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, relu: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, relu=self.relu)
