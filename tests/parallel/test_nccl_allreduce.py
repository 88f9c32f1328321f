"""The dense allreduce of GPU trainers: 2 ranks, NCCL for GPU tensors and gloo for CPU ones (`gpu` tier).

The ranks are forked by `run_local_group` with ``backend_for("cuda")``, rank r on GPU r. A forked
child cannot use CUDA once its parent has, so the test runs this file as a script in a fresh
interpreter, which forks the ranks before touching CUDA; the script checks the ranks' results against
the plain mean and exits non-zero on any difference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from psrec.parallel.allreduce import allreduce_mean, allreduce_mean_
from psrec.parallel.launch import run_local_group
from psrec.parallel.rendezvous import backend_for

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(3, 4), (5,), (), (2, 1, 3)]


def rank_tensors(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def reduce_on_gpus(rank: int, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int, str]:
    """Rank `rank`: the means (new tensors and in place) of its tensors on its GPU, brought back to
    the host, the MAX of a CPU flag (gloo, as the trainers agree on stepping) and the tensors' device."""
    device = torch.device("cuda", rank)
    tensors = [t.to(device) for t in rank_tensors(rank)]
    means = [m.cpu() for m in allreduce_mean(tensors, world_size)]
    allreduce_mean_(tensors, world_size)
    flag = torch.tensor([rank], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return means, [t.cpu() for t in tensors], int(flag.item()), tensors[0].device.type


def main() -> int:
    results = run_local_group(reduce_on_gpus, world_size=2, backend=backend_for("cuda"), timeout=120)
    per_rank = [rank_tensors(rank) for rank in range(2)]
    oracle = [torch.stack([tensors[i] for tensors in per_rank]).mean(dim=0) for i in range(len(SHAPES))]
    for means, in_place, flag, device in results:
        assert device == "cuda" and flag == 1, (device, flag)
        for mean, reduced, expected in zip(means, in_place, oracle, strict=True):
            torch.testing.assert_close(mean, expected)
            torch.testing.assert_close(reduced, expected)
    print("nccl allreduce ok")
    return 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one rank per GPU)")
def test_two_gpu_ranks_average_with_nccl() -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl allreduce ok" in done.stdout


if __name__ == "__main__":
    sys.exit(main())
