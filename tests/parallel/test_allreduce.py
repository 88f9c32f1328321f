"""The dense-gradient allreduce equals the plain mean of every rank's tensors (gloo, forked ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from psrec.parallel.allreduce import allreduce_mean, allreduce_mean_
from psrec.parallel.launch import run_local_group

SHAPES = [(3, 4), (5,), (), (2, 1, 3)]


def rank_tensors(rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s tensors: mixed shapes (a scalar too), different on every rank."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def oracle_mean(ranks: list[int]) -> list[torch.Tensor]:
    per_rank = [rank_tensors(rank) for rank in ranks]
    return [torch.stack([tensors[i] for tensors in per_rank]).mean(dim=0) for i in range(len(SHAPES))]


def reduce_on_world(rank: int, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    tensors = rank_tensors(rank)
    means = allreduce_mean(tensors, world_size)
    untouched = all(torch.equal(t, r) for t, r in zip(tensors, rank_tensors(rank), strict=True))
    allreduce_mean_(tensors, world_size)
    return means, tensors, untouched


def test_world_of_two_gives_the_mean_in_place_and_as_new_tensors() -> None:
    expected = oracle_mean([0, 1])
    for means, in_place, untouched in run_local_group(reduce_on_world, world_size=2):
        assert untouched
        for mean, reduced, oracle in zip(means, in_place, expected, strict=True):
            assert mean.shape == reduced.shape == oracle.shape
            torch.testing.assert_close(mean, oracle)
            torch.testing.assert_close(reduced, oracle)


def reduce_on_subgroups(rank: int, world_size: int) -> list[torch.Tensor]:
    groups = [dist.new_group([0, 2]), dist.new_group([1])]  # every rank creates every group
    tensors = rank_tensors(rank)
    if rank == 1:
        allreduce_mean_(tensors, 1, group=groups[1])
    else:
        allreduce_mean_(tensors, 2, group=groups[0])
    return tensors


def test_a_subgroup_averages_over_its_own_ranks() -> None:
    results = run_local_group(reduce_on_subgroups, world_size=3)
    for rank in (0, 2):
        for reduced, oracle in zip(results[rank], oracle_mean([0, 2]), strict=True):
            torch.testing.assert_close(reduced, oracle)
    for reduced, alone in zip(results[1], rank_tensors(1), strict=True):
        assert torch.equal(reduced, alone)


def test_one_rank_or_no_tensors_needs_no_process_group() -> None:
    assert not dist.is_initialized()
    tensors = rank_tensors(0)
    means = allreduce_mean(tensors, 1)
    assert all(mean is t for mean, t in zip(means, tensors, strict=True))
    allreduce_mean_(tensors, 1)
    assert all(torch.equal(t, r) for t, r in zip(tensors, rank_tensors(0), strict=True))
    assert allreduce_mean([], 4) == []
    allreduce_mean_([], 4)
