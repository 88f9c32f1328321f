"""The `embedding:` section of the run config: each table's dim, sparse optimizer, initializer,
precision, admission and eviction of rows, and disk tier; the tables' defaults and overrides.

Validated with the rest of the run config (`psrec.config.RunConfig`); `psrec.trainer.builders` maps a
`TableConfig` to the plain records of `psrec.embedding.specs` that the tables take.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SparseOptimizerConfig(_Strict):
    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"] = "rowwise_adagrad"
    lr: float = Field(0.01, gt=0)
    eps: float = Field(1e-8, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    initial_accumulator_value: float = Field(0.0, ge=0)
    ftrl_beta: float = Field(1.0, ge=0)
    ftrl_l1: float = Field(0.0, ge=0)
    ftrl_l2: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    lazy: bool = True  # false: every row steps at every push (dense-Adam semantics; small tables)


class InitializerConfig(_Strict):
    kind: Literal["normal", "uniform", "zeros"] = "normal"
    std: float = Field(0.01, ge=0)
    scale: float = Field(0.05, ge=0)


class AdmissionConfig(_Strict):
    kind: Literal["always", "min_count", "probability"] = "always"
    min_count: int = Field(1, ge=1)
    probability: float = Field(1.0, gt=0, le=1)
    sketch_width: int = Field(1 << 20, ge=1)
    sketch_depth: int = Field(4, ge=1, le=16)


class EvictionConfig(_Strict):
    ttl_steps: int | None = Field(None, ge=1)
    max_rows: int | None = Field(None, ge=1)
    every_steps: int = Field(1000, ge=1, description="how often the trainer asks shards to evict")


class StorageConfig(_Strict):
    """A disk tier (docs/disk_tier.md): each shard keeps the table's hottest rows in memory, the rest
    in a file under disk_dir. Give memory_rows or memory_gb."""

    memory_rows: int | None = Field(None, ge=1, description="rows each shard keeps in memory")
    memory_gb: float | None = Field(
        None, gt=0, description="memory each shard gives this table: hot rows, their state, both indexes"
    )
    disk_dir: str = Field(min_length=1, description="a local directory for the cold rows (SSD)")
    prefetch_min_rows: int = Field(
        256,  # psrec.embedding.specs.PREFETCH_MIN_ROWS (config imports no table code)
        ge=0,
        description="read the cold rows of each next batch ahead, on a background thread, while the table's "
        "last training pull promoted at least this many rows (for fewer, issuing the read costs more than "
        "it saves); 0: always",
    )

    @model_validator(mode="after")
    def _one_budget(self) -> StorageConfig:
        if (self.memory_rows is None) == (self.memory_gb is None):
            raise ValueError("storage needs exactly one of memory_rows and memory_gb")
        return self


class TableConfig(_Strict):
    dim: int = Field(16, ge=1)
    expected_rows: int | None = Field(
        None,
        ge=0,
        description="rows the table is expected to reach: shards reserve their share up front (no growth "
        "copies while the rows arrive) and the collective planner balances by it",
    )
    populate: bool = Field(
        True,
        description="back the rows reserved for expected_rows with memory when the table is built, not "
        "in the steps that first write them (false: memory is committed as rows arrive)",
    )
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    initializer: InitializerConfig = InitializerConfig()
    precision: Literal["fp32", "fp16", "int8"] = "fp32"
    stochastic_rounding: bool = False
    admission: AdmissionConfig = AdmissionConfig()
    eviction: EvictionConfig = EvictionConfig()
    storage: StorageConfig | None = None

    @model_validator(mode="after")
    def _storage_needs_lazy(self) -> TableConfig:
        if self.storage is not None and not self.optimizer.lazy:
            raise ValueError("storage (a disk tier) needs optimizer.lazy: true")
        return self


class EmbeddingConfig(_Strict):
    default: TableConfig | None = TableConfig()
    tables: dict[str, TableConfig] = {}
    # Optimizer of the dim-1 first-order tables of models with linear terms (LR, FM, DeepFM, ...).
    linear_optimizer: SparseOptimizerConfig | None = None
