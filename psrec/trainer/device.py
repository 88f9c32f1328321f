"""A trainer's device: where its dense model runs (`training.device`), and the copies to and from it.

``training.device`` is ``cpu`` (the default), ``cuda`` or ``auto`` (cuda when the trainer's process
sees a CUDA device). It is resolved where the trainer runs (`resolve_device`): a Ray trainer sees
only the GPUs Ray gave it (``ps.trainer_resources.num_gpus``).

On ``cuda`` the dense model, its optimizer state, the model input and the dense allreduce (NCCL) are
on the GPU; the embedding rows stay with the shards, in host memory. Each step then copies

- the pulled rows (NumPy, from the PS client) into pinned host memory and from there to the GPU,
  without waiting (`to_device`); labels, dense features and the lookup's indices go the same way;
- the rows' gradients back into pinned host memory (`to_host`), which the push sends to the shards.

On ``cpu`` nothing here runs: the lookup keeps its numba kernels over the pulled buffers, with no
copy (`psrec.trainer.lookup`). See docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from psrec.config import ConfigError

DEVICES = ("cpu", "cuda", "auto")
Key = TypeVar("Key")


def resolve_device(setting: str, *, cuda_available: bool, pipeline: bool = False) -> str:
    """The device ("cpu" or "cuda") of `training.device` = `setting`, in a process that does (not) see
    a CUDA device; `auto` stays on the CPU with ``ps.pipeline`` (its stages exchange CPU tensors). Asking for
    cuda without one is a ConfigError saying what to do."""
    if setting not in DEVICES:
        raise ConfigError(f"training.device must be one of {', '.join(DEVICES)}, not {setting!r}")
    if setting == "cpu" or (setting == "auto" and (pipeline or not cuda_available)):
        return "cpu"
    if not cuda_available:
        raise ConfigError(
            f"training.device 'cuda': this trainer sees no CUDA device (torch {torch.__version__}, "
            "torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU and a CUDA "
            "build of torch (with ps.runtime ray, give each trainer ps.trainer_resources.num_gpus: 1), "
            "or set training.device to cpu, or to auto to use a GPU only where there is one"
        )
    return "cuda"


def pinned(array: np.ndarray) -> torch.Tensor:
    """A copy of `array` in pinned (page-locked) host memory, which a GPU copies from asynchronously."""
    return torch.from_numpy(np.require(array, requirements="W")).pin_memory()


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`: on the CPU the array's own memory (no copy); on a GPU a copy
    staged in pinned host memory and sent without waiting (the caching host allocator keeps the pinned
    block until the copy is done)."""
    if device.type == "cpu":
        return torch.from_numpy(np.require(array, requirements="W"))
    return pinned(array).to(device, non_blocking=True)


def to_host(tensors: Mapping[Key, torch.Tensor]) -> dict[Key, np.ndarray]:
    """The tensors as NumPy arrays in host memory: views of CPU tensors; GPU tensors copied into pinned
    buffers without waiting, then one wait for all of them."""
    out: dict[Key, np.ndarray] = {}
    waits: set[torch.device] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            out[name] = tensor.numpy()
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        out[name] = host.numpy()
        waits.add(tensor.device)
    for device in waits:
        torch.cuda.current_stream(device).synchronize()
    return out


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values in a NumPy array (a view on the CPU, a copy from a GPU)."""
    return tensor.detach().cpu().numpy()


def host_copy(value: Any) -> Any:
    """A copy of `value` (a tensor, or dicts / lists of them) with every tensor in host memory: a
    trainer's state as checkpoints, snapshots and other trainers receive it, whatever its device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v) for v in value]
    return value
