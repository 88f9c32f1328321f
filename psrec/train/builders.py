"""Builders: map the validated run config to plain constructor arguments of library objects.

This is the one place where `RunConfig` meets the embedding engine, the shard, the client and the
models, so every other module takes plain arguments.
"""

from __future__ import annotations

import numpy as np
import torch

from psrec.config import InitializerConfig, RunConfig, SparseOptimizerConfig, TableConfig
from psrec.embedding import AdmissionSpec, EmbeddingTable, EvictionSpec, InitializerSpec, SparseOptimizerSpec
from psrec.models import build_model
from psrec.models.config import uses_linear_terms as model_uses_linear_terms
from psrec.ps.client import linear_table_name
from psrec.ps.routing import default_bucket_map


def _optimizer_spec(config: SparseOptimizerConfig) -> SparseOptimizerSpec:
    return SparseOptimizerSpec(**config.model_dump())


def build_table(name: str, config: TableConfig, *, seed: int) -> EmbeddingTable:
    return EmbeddingTable(
        name,
        config.dim,
        optimizer=_optimizer_spec(config.optimizer),
        initializer=InitializerSpec(**config.initializer.model_dump()),
        precision=config.precision,
        stochastic_rounding=config.stochastic_rounding,
        admission=AdmissionSpec(**config.admission.model_dump()),
        eviction=EvictionSpec(ttl_steps=config.eviction.ttl_steps, max_rows=config.eviction.max_rows),
        seed=seed,
    )


def uses_linear_terms(config: RunConfig) -> bool:
    return model_uses_linear_terms(config.model)


def table_specs(config: RunConfig) -> dict[str, TableConfig]:
    """Every table a shard holds (a partition of): the schema's tables plus linear companions."""
    specs = {name: config.table_config(name) for name in config.table_names()}
    if uses_linear_terms(config):
        for name in list(specs):
            base = specs[name]
            specs[linear_table_name(name)] = TableConfig(
                dim=1,
                optimizer=config.embedding.linear_optimizer or base.optimizer,
                initializer=InitializerConfig(kind="zeros"),
                admission=base.admission,
                eviction=base.eviction,
            )
    return specs


def build_tables(config: RunConfig) -> dict[str, EmbeddingTable]:
    """One shard's tables. Every shard uses the same seeds: a row's initial value depends on its id only."""
    seed = config.training.seed
    return {
        name: build_table(name, spec, seed=seed * 1_000_003 + index)
        for index, (name, spec) in enumerate(sorted(table_specs(config).items()))
    }


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


def build_dense_optimizer(config: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    spec = config.training.dense_optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)


def feature_tables(config: RunConfig) -> dict[str, str]:
    return {f.name: f.table for f in config.feature_schema().sparse}


def sequence_tables(config: RunConfig) -> dict[str, str]:
    tables = {f.name: f.table for f in config.feature_schema().sequences}
    if config.model.name == "sasrec" and "seq" in tables:
        tables.setdefault("candidates", tables["seq"])  # evaluation candidates are items too
    return tables
