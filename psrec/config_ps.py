"""The `ps:` section of the run config: where the tables live (PS shard actors or the trainers),
how many shards and trainers, sync or async steps, the actors' resources and placement, pipeline
stages and shard autoscaling, with the rules that tie these settings together.

Validated with the rest of the run config (`psrec.config.RunConfig`); `psrec.cluster.placement`
takes its resources and placement, the runtimes the rest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResourcesConfig(_Strict):
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory_gb: float | None = Field(None, gt=0)
    threads: int = Field(1, ge=1, description="torch/numba threads in the process")


class PipelineConfig(_Strict):
    """Pipeline parallelism of the dense model (SASRec, BST): ``ps.num_trainers`` = replicas x stages.

    Trainer r is stage r % stages of replica r // stages; the first stage of each replica reads its
    replica's share of the data and talks to the PS (see docs/parallelism.md, `psrec.trainer.pipeline_step`).
    """

    stages: int = Field(ge=2, description="stages per replica: embedding first, blocks dealt out, head last")
    microbatches: int = Field(4, ge=1, description="per batch (fewer when they would not split it evenly)")
    schedule: Literal["gpipe", "1f1b"] = "1f1b"


class PlacementConfig(_Strict):
    """Where the actors run on a cluster of several nodes (`psrec.cluster.placement`, docs/cluster.md)."""

    shards: Literal["spread", "any"] = Field(
        "spread", description="spread: one shard per node in turn (Ray SPREAD); any: Ray's default scheduler"
    )
    trainers: Literal["pack", "spread", "any"] = Field(
        "pack", description="pack: as few nodes as possible (a PACK placement group); spread; any"
    )
    shard_node_resource: str | None = Field(
        None,
        min_length=1,
        description="a custom Ray resource (ray start --resources) each shard asks one unit of: pins "
        "shards to the nodes offering it",
    )
    trainer_node_resource: str | None = Field(None, min_length=1, description="the same for trainers")


class AutoscaleConfig(_Strict):
    """Shards added while training when the tables outgrow them (docs/fault_tolerance.md)."""

    max_shard_memory_gb: float = Field(
        gt=0,
        description="a shard whose rows (payload, optimizer state, index and metadata of the rows it "
        "holds in memory) take more than this many GiB: shards are added while training",
    )
    max_shards: int = Field(ge=1, description="never more shards than this")
    fill: float = Field(
        0.75, gt=0, le=1, description="after growing, each shard holds about this fraction of the limit"
    )


class PSConfig(_Strict):
    runtime: Literal["ray", "local"] = "ray"
    strategy: Literal["ps", "collective"] = Field(
        "ps",
        description="ps: tables on shard actors; collective: tables sharded across the trainers (all-to-all)",
    )
    sharding: Literal["row_wise", "table_wise", "auto"] = Field(
        "row_wise",
        description="collective: how tables are split; auto = the sharding planner's choice per table "
        "(needs embedding.*.expected_rows)",
    )
    address: str | None = Field(None, description="join this Ray cluster; None starts an embedded one")
    num_trainers: int = Field(1, ge=1)
    num_shards: int = Field(2, ge=1)
    num_buckets: int = Field(1024, ge=1)
    mode: Literal["sync", "async"] = "sync"
    wire_precision: Literal["fp32", "fp16"] = Field(
        "fp32",
        description="rows pulled from / gradients pushed to shard actors: fp16 halves the bytes "
        "(gradients with a per-row scale); in-process shards are not serialised and ignore it",
    )
    staleness: int = Field(1, ge=0, description="async: steps a trainer may run ahead of its pushed updates")
    shared_memory: bool = Field(
        True,
        description="a trainer and the shard actors on its machine pass pulled and pushed arrays through "
        "shared memory (/dev/shm) instead of Ray's object store; false: always the object store",
    )
    trainer_resources: ResourcesConfig = ResourcesConfig()
    shard_resources: ResourcesConfig = ResourcesConfig(num_cpus=0.5)
    placement: PlacementConfig = PlacementConfig()
    pipeline: PipelineConfig | None = Field(
        None, description="split the dense model into pipeline stages over the trainers (SASRec, BST)"
    )
    autoscale: AutoscaleConfig | None = Field(
        None, description="add shards while training when a shard's rows pass a memory limit"
    )

    @model_validator(mode="after")
    def _check(self) -> PSConfig:
        if self.pipeline is not None:
            stages = self.pipeline.stages
            for field, value, wanted in (
                ("runtime", self.runtime, "ray"),
                ("strategy", self.strategy, "ps"),
                ("mode", self.mode, "sync"),
            ):
                if value != wanted:
                    raise ValueError(
                        f"ps.pipeline needs ps.{field}: {wanted}, got {value!r} "
                        "(the stages are Ray trainers pulling from PS shards in sync steps)"
                    )
            if self.num_trainers % stages:
                raise ValueError(
                    f"ps.pipeline.stages={stages} must divide ps.num_trainers={self.num_trainers} "
                    "(trainers = pipeline replicas x stages)"
                )
        if self.num_shards > self.num_buckets:
            raise ValueError(
                f"num_shards={self.num_shards} is more than num_buckets={self.num_buckets}: "
                "every shard needs at least one virtual bucket; raise ps.num_buckets or lower ps.num_shards"
            )
        if self.autoscale is not None:
            if self.strategy == "collective":
                raise ValueError(
                    "ps.autoscale adds PS shards; strategy 'collective' keeps the tables in the trainers"
                )
            if not self.num_shards <= self.autoscale.max_shards <= self.num_buckets:
                raise ValueError(
                    f"ps.autoscale.max_shards={self.autoscale.max_shards} must be between ps.num_shards="
                    f"{self.num_shards} and ps.num_buckets={self.num_buckets}"
                )
        if self.strategy == "collective" and self.mode != "sync":
            raise ValueError("strategy 'collective' supports mode 'sync' only")
        if self.strategy == "collective" and self.runtime == "local":
            raise ValueError("strategy 'collective' runs on Ray trainers; use runtime 'ray'")
        if self.runtime == "local" and self.num_trainers != 1:
            raise ValueError(
                "runtime 'local' runs one trainer in-process; use runtime 'ray' for num_trainers > 1"
            )
        return self
