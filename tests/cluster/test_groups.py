"""Typed calls to groups of actors (`psrec.cluster.groups`) in process; the same calls on Ray actors
run in every Ray runtime test (tests/train/test_ps_training.py compares the two runtimes)."""

from __future__ import annotations

import pytest

from psrec.cluster.groups import ActorGroup, Partitions
from psrec.embedding import SparseOptimizerSpec, TableSpec, build_table
from psrec.ps.actors import maintenance_name
from psrec.ps.shard import ParameterShard


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, amount: int, *, times: int = 1) -> int:
        self.value += amount * times
        return self.value


def test_a_group_calls_every_member_in_order_and_follows_the_list() -> None:
    members = [Counter(0), Counter(10)]
    group: ActorGroup[Counter] = ActorGroup(lambda: members, on_ray=False)
    assert group.call(Counter.add, 1, times=2) == [2, 12]
    assert group.call_each(Counter.add, [(1,), (5,)]) == [3, 17]
    assert group.call_first(Counter.add, 100) == 103
    assert group.only([1]).call(Counter.add, 1) == [18]
    members.append(Counter(-1))  # the runtime's list changed: the group sees it
    assert len(group) == 3 and group.call(Counter.add, 0) == [103, 18, -1]
    with pytest.raises(ValueError, match="2 argument tuples for 3 members"):
        group.call_each(Counter.add, [(1,), (2,)])


def _shard(index: int) -> ParameterShard:
    spec = TableSpec("t", 4, optimizer=SparseOptimizerSpec("sgd", lr=0.1))
    return ParameterShard(index, {"t": build_table(spec)}, num_trainers=1, mode="sync")


def test_partitions_run_maintenance_methods_and_refuse_others() -> None:
    shards = [_shard(0), _shard(1)]
    partitions = Partitions(ActorGroup(lambda: shards, on_ray=False), held_by="process")
    stats = partitions.call(ParameterShard.stats)
    assert stats == [shard.stats() for shard in shards] and set(stats[0]) == {"t"}
    assert maintenance_name(ParameterShard.stats) == "stats"
    for other in (ParameterShard.pull, Counter.add):  # not a maintenance method of a shard
        with pytest.raises(ValueError, match="maintenance methods"):
            maintenance_name(other)
    with pytest.raises(ValueError, match="held by"):
        Partitions(ActorGroup(lambda: shards, on_ray=False), held_by="elsewhere")
