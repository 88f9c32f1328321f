"""The input file of `psrec plan`: table sizes, devices and strategy, validated at the boundary.

A run config does not know how many rows its hash tables will grow to, nor how much memory the
devices have, so the planner reads its own small YAML file (``examples/plan_criteo_terabyte.yaml``)::

    strategy: collective          # ps | collective
    sharding: auto                # table_wise | row_wise | auto (collective only)
    num_buckets: 1024
    devices: {count: 8, memory_gb: 80, headroom: 0.1}   # disk_gb: the disk tier's room per device
    disk_tier: false              # true: keep in memory what fits, the rest of every table on disk
    workload: {batch_size: 8192, dense_parameters: 0}   # per trainer and step
    table_defaults: {dim: 128, precision: fp32, optimizer: rowwise_adagrad, ids_per_sample: 1}
    tables:
      C1: {rows: 39884406}
      C2: 39043                   # shorthand for {rows: 39043}

`load_plan_spec(path)` validates it (pydantic, field paths in the message) and `PlanSpec.inputs()`
turns it into the planner's plain arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from psrec.config import apply_overrides, format_validation_error
from psrec.parallel.planner import GB, Devices, TableSize, Workload


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableDefaults(_Strict):
    dim: int = Field(16, ge=1)
    precision: Literal["fp32", "fp16", "int8"] = "fp32"
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"] = "rowwise_adagrad"
    ids_per_sample: float = Field(1.0, ge=0)


class TableEntry(_Strict):
    rows: int = Field(ge=0)
    dim: int | None = Field(None, ge=1)
    precision: Literal["fp32", "fp16", "int8"] | None = None
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"] | None = None
    ids_per_sample: float | None = Field(None, ge=0)
    memory_rows: int | None = Field(None, ge=0, description="with a disk tier: rows kept in memory in all")


class DevicesEntry(_Strict):
    count: int = Field(ge=1)
    memory_gb: float = Field(gt=0, description="per device, in 10^9 bytes")
    headroom: float = Field(0.1, ge=0, lt=1)
    disk_gb: float | None = Field(None, gt=0, description="per device, for the disk tier, in 10^9 bytes")


class WorkloadEntry(_Strict):
    batch_size: int = Field(4096, ge=1, description="per trainer and step")
    num_trainers: int | None = Field(None, ge=1, description="strategy ps: trainers talking to the shards")
    dense_parameters: int = Field(0, ge=0)


class PlanSpec(_Strict):
    strategy: Literal["ps", "collective"] = "collective"
    sharding: Literal["table_wise", "row_wise", "auto"] = "auto"
    num_buckets: int = Field(1024, ge=1)
    devices: DevicesEntry
    workload: WorkloadEntry = WorkloadEntry()
    table_defaults: TableDefaults = TableDefaults()
    tables: dict[str, TableEntry] = Field(min_length=1)
    disk_tier: bool = Field(
        False, description="plan memory_rows per table: what fits in memory, the rest on disk"
    )

    @field_validator("tables", mode="before")
    @classmethod
    def _rows_shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {
                name: {"rows": entry} if isinstance(entry, int) else entry for name, entry in value.items()
            }
        return value

    def table_sizes(self) -> list[TableSize]:
        d = self.table_defaults
        return [
            TableSize(
                name,
                rows=entry.rows,
                dim=entry.dim or d.dim,
                precision=entry.precision or d.precision,
                optimizer=entry.optimizer or d.optimizer,
                ids_per_sample=d.ids_per_sample if entry.ids_per_sample is None else entry.ids_per_sample,
                memory_rows=entry.memory_rows,
            )
            for name, entry in self.tables.items()
        ]

    def inputs(self) -> dict[str, Any]:
        """Keyword arguments of `plan_sharding`."""
        return {
            "tables": self.table_sizes(),
            "devices": Devices(
                self.devices.count,
                int(self.devices.memory_gb * GB),
                headroom=self.devices.headroom,
                disk_bytes=None if self.devices.disk_gb is None else int(self.devices.disk_gb * GB),
            ),
            "strategy": self.strategy,
            "sharding": self.sharding,
            "num_buckets": self.num_buckets,
            "workload": Workload(
                batch_size=self.workload.batch_size,
                num_trainers=self.workload.num_trainers,
                dense_parameters=self.workload.dense_parameters,
            ),
        }


class PlanSpecError(ValueError):
    """An unreadable or invalid plan file; the message names the field."""


def parse_plan_spec(
    data: Any, *, source: str = "<plan>", overrides: dict[str, Any] | None = None
) -> PlanSpec:
    """Validate a plan dict; `overrides` maps dotted paths to values (e.g. {"devices.count": 2})."""
    if not isinstance(data, dict):
        raise PlanSpecError(f"{source}: the plan file must be a mapping at the top level")
    try:
        return PlanSpec.model_validate(apply_overrides(data, overrides))
    except ValidationError as error:
        raise PlanSpecError(format_validation_error(source, error, what="plan file")) from None


def load_plan_spec(path: str | Path, *, overrides: dict[str, Any] | None = None) -> PlanSpec:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise PlanSpecError(f"cannot read plan file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise PlanSpecError(f"{path}: not valid YAML: {error}") from None
    return parse_plan_spec(data, source=str(path), overrides=overrides)
