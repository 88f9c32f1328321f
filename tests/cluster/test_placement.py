"""Placement decisions without Ray: actor options, bundles, the report written to summary.json."""

from __future__ import annotations

import pytest

from psrec.cluster.placement import actor_options, bundle, describe, placement_report
from psrec.config import ConfigError, parse_config
from psrec.config_ps import PlacementConfig, ResourcesConfig


def test_spread_shards_ask_for_ray_spread_and_one_unit_of_a_pinning_resource() -> None:
    resources = ResourcesConfig(num_cpus=0.5, memory_gb=1.0)
    options = actor_options(resources, strategy="spread", node_resource="psrec_shard")
    assert options == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
        "memory": 2**30,
        "resources": {"psrec_shard": 1.0},
        "scheduling_strategy": "SPREAD",
    }
    assert "scheduling_strategy" not in actor_options(resources, strategy="any", node_resource=None)


def test_a_bundle_holds_only_what_the_actor_asks_for() -> None:
    assert bundle(ResourcesConfig(num_cpus=1), None) == {"CPU": 1.0}
    assert bundle(ResourcesConfig(num_cpus=0, num_gpus=1), "gpu_node") == {"GPU": 1.0, "gpu_node": 1.0}
    assert bundle(ResourcesConfig(num_cpus=0), None) == {}  # nothing to reserve: no placement group


def test_the_report_counts_nodes_per_kind_of_actor() -> None:
    shards = [
        {"node_id": node, "node_ip": "10.0.0.1", "pid": i} for i, node in enumerate(["a", "b", "c", "a"])
    ]
    trainers = [{"node_id": "a", "node_ip": "10.0.0.1", "pid": 9}]
    report = placement_report(PlacementConfig(), shards=shards, trainers=trainers, nodes=4)
    assert (report["shard_nodes"], report["trainer_nodes"], report["nodes_used"], report["nodes_alive"]) == (
        3,
        1,
        3,
        4,
    )
    assert [s["index"] for s in report["shards"]] == [0, 1, 2, 3]
    assert report["policy"] == {
        "shards": "spread",
        "trainers": "pack",
        "shard_node_resource": None,
        "trainer_node_resource": None,
    }
    assert describe(report).startswith("placement on 3 of 4 nodes: 10.0.0.1/a: shard 0, shard 3, trainer 0")


def test_placement_config_is_checked_at_the_boundary() -> None:
    from psrec.data.synth import criteo_schema

    data = {"schema": criteo_schema().model_dump(), "train": {"format": "parquet", "paths": ["x.parquet"]}}
    with pytest.raises(ConfigError, match=r"ps\.placement\.shards"):
        parse_config(
            {"run_dir": "r", "data": data, "model": {"name": "lr"}}, overrides={"ps.placement.shards": "pack"}
        )
