"""The dense-gradient allreduce: average a list of tensors across a process group.

Data-parallel trainers (`psrec.trainer.step.StepRunner`) average their dense gradients and batch-norm
statistics with it, and pipeline replicas (`psrec.parallel.pipeline.PipelineStepper`) the gradients of
a stage over the ranks holding that stage. The tensors are flattened into one buffer so that the
group runs a single ``all_reduce`` (sum), which is then divided by the group's size::

    allreduce_mean_([p.grad for p in parameters], world_size)          # in place, the default group
    means = allreduce_mean(grads, num_replicas, group=data_parallel_group)  # new tensors, a subgroup

Every rank must pass tensors of the same shapes and dtypes in the same order; a parameter whose
``.grad`` is None has to be given a zero gradient first (the callers do it), so that all ranks reduce
the same buffer. `tests/parallel/test_allreduce.py` checks it against the plain mean of the ranks'
tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce_mean(
    tensors: list[torch.Tensor], world_size: int, *, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Each tensor's mean over the `world_size` ranks of `group` (default: the world), as a view of one
    flat buffer; the input tensors are left as they are.

    One flat allreduce over the concatenated tensors. With `world_size` 1 (no process group needed)
    or no tensors, the tensors themselves are returned.
    """
    if world_size == 1 or not tensors:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= world_size
    means = []
    offset = 0
    for t in tensors:
        means.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return means


def allreduce_mean_(
    tensors: list[torch.Tensor], world_size: int, *, group: dist.ProcessGroup | None = None
) -> None:
    """`allreduce_mean` in place: each tensor is overwritten with its mean over the ranks."""
    if world_size == 1 or not tensors:
        return
    for t, mean in zip(tensors, allreduce_mean(tensors, world_size, group=group), strict=True):
        t.copy_(mean)
