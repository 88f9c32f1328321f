"""Where shard and trainer actors run on a Ray cluster of several nodes.

`ps.placement` chooses, per kind of actor:

- ``spread``: one actor per node in turn (Ray's SPREAD scheduling), the default for shards, so that
  one node's loss takes as few shards as possible with it and the shards' memory and network load
  is spread over the nodes;
- ``pack``: all of them on as few nodes as possible (a Ray placement group with the PACK strategy,
  one bundle per actor), the default for trainers, so that the dense allreduce stays within a node
  when it fits there;
- ``any``: Ray's default scheduler.

A custom node resource pins a kind of actor to the nodes that offer it (``ray start --resources
'{"psrec_shard": 4}'`` on the nodes meant for shards, ``ps.placement.shard_node_resource:
psrec_shard``): each actor asks one unit of it, so a node offering 4 takes up to 4 shards.

`actor_options` turns that into the options of one `ActorClass.options(...)` call;
`TrainerGroup` owns the trainers' placement group (a new one every time the trainers are started,
so a group whose bundles sat on a lost node is never waited for); `placement_report` summarises
where each actor landed, for the log and `summary.json`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any

from psrec.config import ConfigError
from psrec.config_ps import PlacementConfig, ResourcesConfig

logger = logging.getLogger(__name__)

PLACEMENT_GROUP_TIMEOUT_S = 120.0


def actor_resources(resources: ResourcesConfig, node_resource: str | None) -> dict[str, Any]:
    """num_cpus / num_gpus / memory of one actor, and one unit of `node_resource` when given."""
    options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.memory_gb is not None:
        options["memory"] = int(resources.memory_gb * 2**30)
    if node_resource is not None:
        options["resources"] = {node_resource: 1.0}
    return options


def bundle(resources: ResourcesConfig, node_resource: str | None) -> dict[str, float]:
    """The placement-group bundle one actor with these resources needs (Ray's resource names)."""
    needs: dict[str, float] = {"CPU": resources.num_cpus, "GPU": resources.num_gpus}
    if resources.memory_gb is not None:
        needs["memory"] = float(int(resources.memory_gb * 2**30))
    if node_resource is not None:
        needs[node_resource] = 1.0
    return {name: amount for name, amount in needs.items() if amount > 0}


def actor_options(
    resources: ResourcesConfig,
    *,
    strategy: str,
    node_resource: str | None,
    placement_group: Any = None,
    bundle_index: int = 0,
) -> dict[str, Any]:
    """Options for `ActorClass.options(**...)`: resources and the scheduling strategy."""
    options = actor_resources(resources, node_resource)
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    elif strategy == "spread":
        options["scheduling_strategy"] = "SPREAD"
    return options


class TrainerGroup:
    """The trainers' placement group under ``pack`` (a PACK group, one bundle per trainer).

    `start(count)` removes the previous group (killing what still runs in it) and reserves a new
    one, waiting at most `timeout` seconds: a cluster that cannot hold the trainers fails here with
    the bundles it asked for, not in a hang.
    """

    def __init__(
        self, resources: ResourcesConfig, *, strategy: str, node_resource: str | None, timeout: float
    ) -> None:
        self.resources = resources
        self.strategy = strategy
        self.node_resource = node_resource
        self.timeout = timeout
        self.group: Any = None

    def start(self, count: int) -> list[dict[str, Any]]:
        """The actor options of `count` trainers, reserving their placement group first under pack."""
        self.remove()
        needs = bundle(self.resources, self.node_resource)
        if self.strategy == "pack" and needs:
            from ray.util.placement_group import placement_group

            self.group = placement_group([dict(needs) for _ in range(count)], strategy="PACK")
            import ray

            ready, _ = ray.wait([self.group.ready()], timeout=self.timeout)
            if not ready:
                self.remove()
                raise ConfigError(
                    f"ps.placement.trainers: pack: the Ray cluster could not reserve {count} x {needs} for "
                    f"the trainers within {self.timeout:.0f} s; lower ps.trainer_resources, add nodes, or "
                    "set ps.placement.trainers: any"
                )
        return [
            actor_options(
                self.resources,
                strategy=self.strategy,
                node_resource=self.node_resource,
                placement_group=self.group,
                bundle_index=index,
            )
            for index in range(count)
        ]

    def remove(self) -> None:
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # best effort: the group may be gone with its nodes
            remove_placement_group(self.group)
        self.group = None


def placement_report(
    placement: PlacementConfig,
    *,
    shards: list[dict[str, Any]],
    trainers: list[dict[str, Any]],
    nodes: int,
) -> dict[str, Any]:
    """Where every actor runs: the policy, each actor's node, and actors per node.

    shards, trainers: `location()` of each actor in index order ({"node_id", "node_ip", "pid"}).
    """
    per_node: Counter[str] = Counter()
    for location in [*shards, *trainers]:
        per_node[location["node_id"]] += 1
    return {
        "policy": placement.model_dump(),
        "nodes_alive": nodes,
        "nodes_used": len(per_node),
        "shards": [{"index": i, **location} for i, location in enumerate(shards)],
        "trainers": [{"index": i, **location} for i, location in enumerate(trainers)],
        "shard_nodes": len({location["node_id"] for location in shards}),
        "trainer_nodes": len({location["node_id"] for location in trainers}),
    }


def describe(report: dict[str, Any]) -> str:
    """One log line: which node runs which actors."""
    by_node: dict[str, list[str]] = {}
    for kind in ("shards", "trainers"):
        for entry in report[kind]:
            label = f"{entry['node_ip']}/{entry['node_id'][:8]}"
            by_node.setdefault(label, []).append(f"{kind[:-1]} {entry['index']}")
    parts = [f"{node}: {', '.join(actors)}" for node, actors in sorted(by_node.items())]
    return f"placement on {report['nodes_used']} of {report['nodes_alive']} nodes: " + "; ".join(parts)
