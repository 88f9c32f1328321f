"""Builders: map the validated run config to plain constructor arguments of library objects.

This is the one place where `RunConfig` meets the embedding engine, the shard, the client and the
models, so every other module takes plain arguments. torch is imported only by the functions that build
the dense model and its optimizer: the driver of a Ray run maps the config to its shards' tables
without it, and starts its cluster and actors before (or without) importing torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from psrec.config import ConfigError, RunConfig
from psrec.config_embedding import InitializerConfig, SparseOptimizerConfig, TableConfig
from psrec.embedding import (
    AdmissionSpec,
    EmbeddingTable,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    StorageSpec,
    TableSpec,
    build_table,
)
from psrec.embedding.disk_tier import DiskTierError, check_disk_dir
from psrec.embedding.sizes import DISK_SPACE_FACTOR, disk_bytes_per_row, memory_rows_for_budget
from psrec.machine import DensePrecision, isa_features, resolve_dense_precision
from psrec.models import build_model
from psrec.models.config import uses_linear_terms as model_uses_linear_terms
from psrec.ps.client import LINEAR_SUFFIX, linear_table_name
from psrec.ps.routing import default_bucket_map

if TYPE_CHECKING:
    import torch

    from psrec.data.background import InputGate
    from psrec.parallel.row_owners import Placement
    from psrec.trainer.dense_optimizer import DenseOptimizer
    from psrec.trainer.lookup import BatchLookup
    from psrec.trainer.runner import Runner


def _optimizer_spec(config: SparseOptimizerConfig) -> SparseOptimizerSpec:
    return SparseOptimizerSpec(**config.model_dump())


def build_table_spec(name: str, config: TableConfig, *, seed: int, initial_rows: int = 0) -> TableSpec:
    """`name`'s spec on one shard; `initial_rows` is the shard's share of ``expected_rows``."""
    return TableSpec(
        name,
        config.dim,
        optimizer=_optimizer_spec(config.optimizer),
        initializer=InitializerSpec(**config.initializer.model_dump()),
        precision=config.precision,
        stochastic_rounding=config.stochastic_rounding,
        admission=AdmissionSpec(**config.admission.model_dump()),
        eviction=EvictionSpec(ttl_steps=config.eviction.ttl_steps, max_rows=config.eviction.max_rows),
        seed=seed,
        initial_rows=initial_rows,
        populate=config.populate,
        storage=storage_spec(name, config, shard_rows=initial_rows),
    )


def storage_spec(name: str, config: TableConfig, *, shard_rows: int) -> StorageSpec | None:
    """A shard's disk tier of table `name`: ``memory_rows`` as given, or as many rows as fit
    ``memory_gb`` with the disk tier's index of the shard's other rows (`shard_rows` expected in
    all). The directory is checked here, before training: it must exist, be writable and have room
    for a record of every expected row; otherwise a ConfigError names it."""
    storage = config.storage
    if storage is None:
        return None
    where = f"embedding table {name!r} storage"
    dim, precision, optimizer = config.dim, config.precision, config.optimizer.name
    if storage.memory_rows is not None:
        memory_rows = storage.memory_rows
    else:
        try:
            memory_rows = memory_rows_for_budget(
                float(storage.memory_gb or 0) * 2**30,
                dim=dim,
                precision=precision,
                optimizer=optimizer,
                expected_rows=shard_rows,
            )
        except ValueError as error:
            raise ConfigError(f"{where}: memory_gb {storage.memory_gb}: {error}") from None
    disk_rows = shard_rows if shard_rows > memory_rows else 0  # every row may come to be on disk
    record = disk_bytes_per_row(dim, precision=precision, optimizer=optimizer)
    try:  # the log-structured file's garbage included
        directory = check_disk_dir(
            storage.disk_dir, table=name, needed_bytes=int(disk_rows * record * DISK_SPACE_FACTOR)
        )
    except DiskTierError as error:
        raise ConfigError(str(error)) from None
    return StorageSpec(
        memory_rows=memory_rows,
        disk_dir=os.path.abspath(directory),
        prefetch_min_rows=storage.prefetch_min_rows,
    )


def uses_linear_terms(config: RunConfig) -> bool:
    return model_uses_linear_terms(config.model)


def table_specs(config: RunConfig) -> dict[str, TableConfig]:
    """Every table a shard holds (a partition of): the schema's tables plus linear companions.

    ``training.embedding_l2`` (L2 on the rows a step touches, as BARS does) is applied by the shard's
    optimizer as weight decay of the embedding tables (not the linear ones): the shard sees the union
    of every trainer's rows of the step, so each touched row is decayed once per step whatever the
    number of trainers (a penalty added to each trainer's loss would decay a row seen by one trainer
    of N only 1/N as much).
    """
    specs = {
        name: _with_l2(config.table_config(name), config.training.embedding_l2)
        for name in config.table_names()
    }
    if uses_linear_terms(config):
        for name in list(specs):
            base = config.table_config(name)  # without embedding_l2: the linear tables are exempt
            specs[linear_table_name(name)] = TableConfig(
                dim=1,
                optimizer=config.embedding.linear_optimizer or base.optimizer,
                initializer=InitializerConfig(kind="zeros"),
                admission=base.admission,
                eviction=base.eviction,
                populate=base.populate,
            )
    return specs


def _with_l2(spec: TableConfig, l2: float) -> TableConfig:
    if l2 == 0:
        return spec
    optimizer = spec.optimizer.model_copy(update={"weight_decay": spec.optimizer.weight_decay + l2})
    return spec.model_copy(update={"optimizer": optimizer})


def shard_table_specs(config: RunConfig, *, partitions: int = 1) -> list[TableSpec]:
    """The specs of one shard's tables. Every shard uses the same seeds: a row's initial value depends
    on its id only.

    A table with ``expected_rows`` reserves its share up front (1/`partitions` of the rows, +5% for
    uneven buckets), so it does not grow, and copy its arrays, while those rows arrive.
    """
    seed = config.training.seed
    specs = []
    for index, (name, spec) in enumerate(sorted(table_specs(config).items())):
        expected = config.table_config(name.removesuffix(LINEAR_SUFFIX)).expected_rows or 0
        share = int(expected * 1.05 / partitions) + 1 if expected else 0
        specs.append(build_table_spec(name, spec, seed=seed * 1_000_003 + index, initial_rows=share))
    return specs


def build_tables(config: RunConfig, *, partitions: int = 1) -> dict[str, EmbeddingTable]:
    """One shard's tables (`shard_table_specs`, built)."""
    return {spec.name: build_table(spec) for spec in shard_table_specs(config, partitions=partitions)}


def pushing_trainers(config: RunConfig) -> int:
    """Trainers whose pushes complete a sync step on a shard: all of them, or with ``ps.pipeline`` the
    first stage of each replica (the other stages never touch the tables)."""
    pipeline = config.ps.pipeline
    return config.ps.num_trainers if pipeline is None else config.ps.num_trainers // pipeline.stages


def bucket_map(config: RunConfig) -> np.ndarray:
    return default_bucket_map(config.ps.num_buckets, config.ps.num_shards)


def build_model_for(config: RunConfig) -> torch.nn.Module:
    schema = config.feature_schema()
    dims = {config.table_config(t).dim for t in config.table_names()}
    return build_model(
        config.model,
        num_dense=len(schema.dense),
        num_sparse=len(schema.sparse),
        embedding_dim=dims.pop() if dims else 1,
    )


# The training contract's entry points (`psrec.models.base`): what the step and evaluation call.
COMPILED_METHODS = ("loss", "predict")


def compile_dense_model(model: torch.nn.Module) -> torch.nn.Module:
    """Compile `model`'s `loss` and `predict` in place with `torch.compile` (inductor, default mode).

    The methods, not `forward`, are what the trainer calls: compiling them covers the loss head too
    (BCE + sigmoid fuse into the graph) and SASRec, whose `loss` does not go through `forward`. The
    module itself is unchanged, so `state_dict` keys stay as they are (no `_orig_mod.` prefix) and
    checkpoints of compiled and eager runs are interchangeable.

    Shapes: each method is first compiled for the batch size it sees; the first different size (an
    epoch's last, smaller batch) recompiles it once with a dynamic batch dimension, which then serves
    every size (PyTorch's automatic dynamic shapes; on CPU as fast as the static graph, measured on
    the bench DLRM). Train and eval are separate frames; autocast and grad mode are guarded, so a run
    compiles 2 graphs per method at most. Compiling happens lazily, at the first call (seconds), and
    needs a C++ compiler (inductor's CPU backend).
    """
    import torch

    for name in COMPILED_METHODS:
        setattr(model, name, torch.compile(getattr(model, name)))
    return model


def maybe_compile(model: torch.nn.Module, config: RunConfig) -> torch.nn.Module:
    """`compile_dense_model(model)` when `training.compile` is set, else `model` untouched."""
    return compile_dense_model(model) if config.training.compile else model


def training_device(config: RunConfig) -> torch.device:
    """The trainer's device for ``training.device`` (`psrec.trainer.device.resolve_device`), resolved in
    the trainer's own process: a Ray trainer sees only the GPUs Ray gave it. The default, cpu, does
    not touch CUDA at all. ConfigError for cuda where there is none."""
    import torch

    from psrec.trainer.device import resolve_device

    if config.training.device == "cpu":
        return torch.device("cpu")
    available, pipeline = torch.cuda.is_available(), config.ps.pipeline is not None
    if resolve_device(config.training.device, cuda_available=available, pipeline=pipeline) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def dense_precision(config: RunConfig, device: torch.device) -> DensePrecision:
    """What ``training.dense_precision`` resolves to for a model on `device`, decided in the trainer's
    own process from its machine (`psrec.machine.resolve_dense_precision`): ``auto`` is bf16 where
    the CPU (or the GPU) computes bf16 natively, fp32 elsewhere. ``ps.pipeline`` trains in fp32."""
    import torch

    setting = config.training.dense_precision
    if config.ps.pipeline is not None:  # the config allows it fp32 and auto only
        return DensePrecision(setting, "fp32", "ps.pipeline trains the dense model in fp32")
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return resolve_dense_precision(setting, device.type, isa_features(), cuda_bf16=cuda_bf16)


def build_dense_optimizer(config: RunConfig, model: torch.nn.Module) -> DenseOptimizer:
    """torch.optim's Adam / Adagrad / SGD update, without importing torch's compiler (dense_optimizer.py)."""
    from psrec.trainer.dense_optimizer import DenseOptimizer

    spec = config.training.dense_optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    return DenseOptimizer(
        params, spec.name, lr=spec.lr, betas=(spec.beta1, spec.beta2), weight_decay=spec.weight_decay
    )


def build_runner(
    config: RunConfig,
    model: torch.nn.Module,
    optimizer: DenseOptimizer,
    lookup: BatchLookup,
    *,
    rank: int,
    world_size: int,
    bf16: bool,
    input_gate: InputGate | None,
) -> Runner:
    """The steps of trainer `rank` of `world_size`: its stage of a replica under ``ps.pipeline``,
    otherwise the data-parallel `StepRunner` (``ps.mode`` sync or async)."""
    from psrec.trainer.step import StepRunner

    training = config.training
    pipeline = config.ps.pipeline
    if pipeline is not None:
        from psrec.parallel.pipeline import PipelineLayout
        from psrec.trainer.pipeline_step import PipelineStepRunner

        return PipelineStepRunner(
            model,
            optimizer,
            lookup,
            rank=rank,
            layout=PipelineLayout(world_size, pipeline.stages),
            n_microbatches=pipeline.microbatches,
            schedule=pipeline.schedule,
            grad_clip_norm=training.grad_clip_norm,
        )
    return StepRunner(
        model,
        optimizer,
        lookup,
        world_size=world_size,
        mode=config.ps.mode,
        staleness=config.ps.staleness,
        grad_clip_norm=training.grad_clip_norm,
        bf16=bf16,
        input_gate=input_gate,
    )


def feature_tables(config: RunConfig) -> dict[str, str]:
    return {f.name: f.table for f in config.feature_schema().sparse}


def sequence_tables(config: RunConfig) -> dict[str, str]:
    tables = {f.name: f.table for f in config.feature_schema().sequences}
    if config.model.ranks_items and "seq" in tables:
        tables.setdefault("candidates", tables["seq"])  # evaluation candidates are items too
    return tables


def collective_placement(config: RunConfig, world_size: int) -> Placement:
    """Which trainer owns which table / bucket under strategy "collective" (``ps.sharding``).

    ``row_wise`` splits every table over all trainers by bucket. ``table_wise`` and ``auto`` ask the
    sharding planner (``psrec.parallel.planner``) when every table has ``expected_rows``: it packs
    whole tables by size (and, for ``auto``, splits row-wise the tables too large for an even share),
    checking them against ``ps.trainer_resources.memory_gb`` when set; a plan that does not fit raises
    ConfigError with the planner's reason. Without sizes, ``table_wise`` deals tables round-robin.
    The result depends on the config only, so every trainer (and every restart) computes the same.
    """
    from psrec.config import ConfigError
    from psrec.parallel.planner import Devices, PlanDoesNotFit, TableSize, plan_sharding
    from psrec.parallel.row_owners import Placement

    num_buckets = config.ps.num_buckets
    specs = table_specs(config)
    if config.ps.sharding == "row_wise":
        return Placement.row_wise(world_size, num_buckets)
    base = {name: config.table_config(name) for name in config.table_names()}
    rows = {
        name: base.get(name.removesuffix(LINEAR_SUFFIX), spec).expected_rows for name, spec in specs.items()
    }
    if any(value is None for value in rows.values()):
        return Placement.table_wise(sorted(specs), world_size, num_buckets)
    sizes = [
        TableSize(
            name,
            rows=int(rows[name] or 0),
            dim=spec.dim,
            precision=spec.precision,
            optimizer=spec.optimizer.name,
        )
        for name, spec in sorted(specs.items())
    ]
    memory_gb = config.ps.trainer_resources.memory_gb
    devices = Devices(count=world_size, memory_bytes=int(memory_gb * 2**30) if memory_gb else 2**62)
    try:
        plan = plan_sharding(
            sizes, devices, strategy="collective", sharding=config.ps.sharding, num_buckets=num_buckets
        )
    except PlanDoesNotFit as error:
        raise ConfigError(f"ps.sharding {config.ps.sharding!r}: {error}") from None
    return Placement.from_plan(plan)
