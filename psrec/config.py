"""The run configuration: one validated schema for `psrec train CONFIG`.

Loaded once at the entry point (`load_config`), validated with pydantic so a mistake fails before
any process starts, with the field path and the allowed values. Library classes never see this
object: the builders in `psrec.train` map it to plain constructor arguments. The models of the
`embedding:` and `ps:` sections are in `psrec.config_embedding` and `psrec.config_ps`.

A minimal config (see `examples/quickstart.yaml` for a full one)::

    data:
      schema: {label: label, sparse: [{name: C1, table: C1}]}
      train: {format: parquet, paths: [train/*.parquet]}   # or {format: kafka, ...}: docs/streaming.md
    model: {name: dlrm, bottom_mlp: [64, 16], top_mlp: [64, 1]}
    embedding:
      default: {dim: 16, optimizer: {name: rowwise_adagrad, lr: 0.05}}
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from psrec.config_embedding import EmbeddingConfig, TableConfig
from psrec.config_ps import PipelineConfig, PSConfig
from psrec.data.schema import DataSource, KafkaSource, Schema
from psrec.models.config import ModelConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DenseOptimizerConfig(_Strict):
    name: Literal["adam", "adagrad", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1, description="adam only")
    beta2: float = Field(0.999, ge=0, lt=1, description="adam only")
    weight_decay: float = Field(0.0, ge=0)


class EarlyStoppingConfig(_Strict):
    metric: Literal["auc", "logloss", "hr@10", "ndcg@10", "mrr", "full_hr@10", "full_ndcg@10"] = "auc"
    patience: int = Field(2, ge=1)
    lr_decay: float = Field(0.1, gt=0, le=1, description="multiply all learning rates on a plateau")


class StreamTrainingConfig(_Strict):
    """How a continuous run (``training.mode: continuous``) waits for a stream (docs/streaming.md)."""

    wait_seconds: float = Field(
        1.0,
        gt=0,
        description="the longest a trainer waits for the next batch before the driver gets control back "
        "(to report lag, checkpoint, publish, stop); a busy stream trains log_every_steps steps at a time",
    )
    batch_timeout_s: float | None = Field(
        1.0,
        gt=0,
        description="events that waited this long in a batch that is not full train as a short batch "
        "(a quiet stream still trains within seconds); null: batches are always full",
    )
    stop_after_idle_s: float | None = Field(
        None, gt=0, description="end the run when no event arrived for this long (backfills, tests)"
    )
    metrics_window: int = Field(
        100_000,
        ge=1,
        description="progressive validation: the AUC and logloss of the last this-many events, each "
        "scored before the model trained on it",
    )


class TrainingConfig(_Strict):
    mode: Literal["epochs", "continuous"] = Field(
        "epochs",
        description="epochs: train over files (or a Kafka stream read to its end); continuous: train "
        "while a stream's events arrive, checkpoint and publish as it goes, stop on SIGTERM",
    )
    stream: StreamTrainingConfig = StreamTrainingConfig()
    batch_size: int = Field(4096, ge=1)
    eval_batch_size: int = Field(16384, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    dense_optimizer: DenseOptimizerConfig = DenseOptimizerConfig()
    log_every_steps: int = Field(20, ge=1)
    eval_every_steps: int | None = Field(None, ge=1, description="besides the ends of epochs")
    eval_every_epochs: int = Field(
        1,
        ge=1,
        description="validation at the end of every N-th epoch and of the last (long runs whose "
        "evaluation costs as much as an epoch of training: the reference's ML-1M runs evaluate rarely)",
    )
    early_stopping: EarlyStoppingConfig | None = None
    # SASRec: also rank each held-out item among all items (the user's input items excluded), reported
    # as full_hr@K / full_ndcg@K / full_mrr beside the 100-sampled-negative protocol's hr@K / ndcg@K.
    full_ranking: bool = False
    # L2 on the embedding rows each step touches (BARS-style), applied once per step by the shards as
    # the tables' weight decay: exact with any number of trainers. Linear (wide) tables are exempt.
    embedding_l2: float = Field(0.0, ge=0)
    dense_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="bf16: autocast the dense model (embedding rows stay fp32); auto: bf16 where the "
        "trainer's CPU computes bf16 natively (avx512_bf16 or amx_bf16) or its GPU does, fp32 elsewhere "
        "(psrec.machine); an explicit bf16 on a CPU without native bf16 is slower than fp32",
    )
    grad_clip_norm: float | None = Field(None, gt=0)
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu",
        description="where the dense model trains: cuda puts it, its optimizer and the model input on the "
        "trainer's GPU (rows stay on the shards, docs/gpu.md); auto: cuda when the trainer sees one",
    )
    # torch.compile (inductor) the dense model's loss and predict; the first steps take seconds longer
    compile: bool = False
    shuffle_buffer: int = Field(0, ge=0)
    cache_data: bool = Field(
        False,
        description="keep the prepared (decoded, hashed) training rows in memory after the first epoch; "
        "later epochs skip reading and hashing (each trainer holds its share; not for interactions)",
    )
    seed: int = 0


class CheckpointConfig(_Strict):
    """Atomic checkpoints in RUN_DIR/checkpoints: a full one every `full_every`, deltas in between."""

    enabled: bool = True
    every_steps: int | None = Field(None, ge=1, description="besides the end of every epoch")
    every_seconds: float | None = Field(
        None,
        gt=0,
        description="also when this long passed since the last checkpoint (continuous training: how "
        "often a `psrec serve --follow` replica gets the new rows)",
    )
    full_every: int = Field(4, ge=1, description="every Nth checkpoint is full, the others are deltas")
    keep_last: int = Field(2, ge=1, description="restorable chains to keep")


class FaultToleranceConfig(_Strict):
    max_restarts: int = Field(3, ge=0, description="actor failures survived before the run gives up")
    shard_failover: bool = Field(
        True,
        description="a dead shard is rebuilt alone from its checkpoint file and a log of its operations "
        "since (no rollback, nothing recomputed; Ray, strategy ps, checkpoints on; docs/fault_tolerance.md)",
    )
    trainer_failover: bool = Field(
        True,
        description="with shard_failover, sync mode and 2+ trainers: a dead trainer is replaced alone, "
        "its dense replica copied from a survivor (no rollback; docs/fault_tolerance.md)",
    )
    push_log: str | None = Field(
        None,
        min_length=1,
        description="directory of the shards' logs, one every shard's node reaches (default: the "
        "temporary directory, one machine only)",
    )
    push_log_fsync: bool = Field(
        False, description="fsync every log record: survives a lost machine, not only a killed process"
    )


class SyntheticDataConfig(_Strict):
    """Generate Criteo-shaped data into the run directory instead of reading `train`/`validation`."""

    train_rows: int = Field(200_000, ge=1)
    validation_rows: int = Field(50_000, ge=0)
    cardinality_scale: float = Field(0.01, gt=0)
    seed: int = 0
    # also write it prepared (`psrec data convert --prepared`) and read that: no text decoding or hashing
    prepared: bool = False


class DataConfig(_Strict):
    data_schema: Schema | None = Field(None, alias="schema")
    # a file source, or (`format: kafka`) a Kafka stream read to its end as one epoch
    train: Annotated[DataSource | KafkaSource, Field(discriminator="format")] | None = None
    validation: DataSource | None = None
    test: DataSource | None = None
    synthetic: SyntheticDataConfig | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.synthetic is None and (self.train is None or self.data_schema is None):
            raise ValueError(
                "give data.train and data.schema, or data.synthetic for generated Criteo-shaped data"
            )
        return self


class RunConfig(_Strict):
    run_dir: str = "runs/default"
    data: DataConfig
    model: ModelConfig
    embedding: EmbeddingConfig = EmbeddingConfig()
    training: TrainingConfig = TrainingConfig()
    ps: PSConfig = PSConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()

    def feature_schema(self) -> Schema:
        if self.data.data_schema is not None:
            return self.data.data_schema
        from psrec.data.synth import criteo_schema

        return criteo_schema()

    def table_names(self) -> list[str]:
        schema = self.feature_schema()
        names = [f.table for f in schema.sparse] + [f.table for f in schema.sequences]
        return list(dict.fromkeys(names))

    def table_config(self, table: str) -> TableConfig:
        config = self.embedding.tables.get(table, self.embedding.default)
        if config is None:
            raise ConfigError(
                f"embedding.tables: no config for table {table!r} and embedding.default is null"
            )
        return config

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        tables = self.table_names()
        missing = [t for t in tables if t not in self.embedding.tables and self.embedding.default is None]
        if missing:
            raise ValueError(
                f"features are mapped to tables {missing} that embedding.tables does not define "
                "(and embedding.default is null): add them to embedding.tables or set embedding.default"
            )
        unused = sorted(set(self.embedding.tables) - set(tables))
        if unused:
            raise ValueError(f"embedding.tables defines {unused} but no feature of data.schema uses them")
        dims = {t: (self.embedding.tables.get(t) or self.embedding.default).dim for t in tables}  # type: ignore[union-attr]
        if len(set(dims.values())) > 1:
            raise ValueError(f"all tables feeding one model must share a dim, got {dims}")
        if self.ps.pipeline is not None:
            self._check_pipeline(self.ps.pipeline)
        train = self.data.train
        streamed = isinstance(train, KafkaSource) or (
            isinstance(train, DataSource) and train.growing is not None
        )
        if streamed or self.training.mode == "continuous":
            self._check_stream()
        if self.model.ranks_items:
            self._check_sasrec_negatives(getattr(self.model, "loss", "bce"))
        early = self.training.early_stopping
        if self.training.full_ranking and not self.model.ranks_items:
            raise ValueError(
                f"training.full_ranking ranks items for sasrec and hstu, not {self.model.name!r}"
            )
        if early is not None and early.metric.startswith("full_") and not self.training.full_ranking:
            raise ValueError(
                f"training.early_stopping.metric {early.metric!r} needs training.full_ranking: true"
            )
        ftrl = [t for t in tables if self.table_config(t).optimizer.name == "ftrl"]
        if self.training.embedding_l2 > 0 and ftrl:
            raise ValueError(
                f"training.embedding_l2 is applied as the tables' weight decay, but tables {ftrl} use "
                "ftrl, which regularises through optimizer.ftrl_l2: set that instead"
            )
        if (
            self.training.device == "cuda"
            and self.ps.runtime == "ray"
            and self.ps.trainer_resources.num_gpus == 0
        ):
            raise ValueError(
                "training.device 'cuda' with ps.runtime 'ray' needs ps.trainer_resources.num_gpus > 0 "
                "(Ray hides the GPUs from actors that ask for none): set it to 1 (one GPU per trainer)"
            )
        if self.ps.strategy == "collective" and self.ps.sharding == "auto":
            unsized = [t for t in tables if self.table_config(t).expected_rows is None]
            if unsized:
                raise ValueError(
                    f"ps.sharding 'auto' plans by table size, but tables {unsized} have no expected_rows: "
                    "set embedding.default.expected_rows or embedding.tables.<name>.expected_rows, "
                    "or choose ps.sharding row_wise | table_wise"
                )
        return self

    def _check_stream(self) -> None:
        """A Kafka source trains as one bounded epoch or continuously, growing files continuously, in
        the order the stream delivers them."""
        training = self.training
        source = self.data.train
        growing = isinstance(source, DataSource) and source.growing is not None
        if training.mode == "continuous" and not (isinstance(source, KafkaSource) or growing):
            raise ValueError(
                "training.mode 'continuous' trains from a stream: data.train must be of format 'kafka', or "
                f"files with data.train.growing set (it is {getattr(source, 'format', None)!r} without growing)"
            )
        if growing and training.mode != "continuous":
            raise ValueError(
                "data.train.growing follows files as they land: set training.mode: continuous "
                "(or remove growing to train on the files there now)"
            )
        what = "data.train.growing" if growing else "data.train format 'kafka'"
        if training.epochs != 1:
            reason = (
                "a stream has no epochs"
                if training.mode == "continuous"
                else "a stream is read to its end once"
            )
            raise ValueError(
                f"training.epochs: {training.epochs} with {what}: {reason} (set training.epochs: 1)"
            )
        if training.shuffle_buffer != 0:
            raise ValueError(f"training.shuffle_buffer applies to finished files; data.train is {what}")
        if training.mode != "continuous":
            return
        if training.early_stopping is not None:
            raise ValueError(
                "training.early_stopping: a continuous run has no end to stop early at; watch the "
                "progressive validation metrics instead (docs/streaming.md)"
            )
        if self.ps.pipeline is not None or self.ps.strategy != "ps":
            raise ValueError(
                "training.mode 'continuous' runs with ps.strategy 'ps' and no ps.pipeline "
                f"(got strategy {self.ps.strategy!r}, pipeline {'set' if self.ps.pipeline else 'none'})"
            )
        if self.model.ranks_items or getattr(source, "format", None) == "interactions":
            raise ValueError(
                f"training.mode 'continuous' trains CTR models; {self.model.name} reads interaction files"
            )

    def _check_sasrec_negatives(self, loss: str) -> None:
        """model.loss sampled_softmax draws its negatives from data.schema's "negatives" sequence."""
        sequences = {f.name: f for f in self.feature_schema().sequences}
        negatives = sequences.get("negatives")
        if loss == "sampled_softmax" and negatives is None:
            table = sequences["seq"].table if "seq" in sequences else "items"
            raise ValueError(
                "model.loss 'sampled_softmax' needs the negatives in data.schema.sequences: add "
                f"{{name: negatives, table: {table}, max_length: N, hashed: false, namespace: item}} "
                "(N sampled items per user, e.g. 100)"
            )
        if loss == "bce" and negatives is not None:
            raise ValueError(
                "data.schema.sequences has 'negatives', which only model.loss 'sampled_softmax' uses: "
                "set model.loss: sampled_softmax or remove it"
            )
        if negatives is not None and "seq" in sequences and negatives.table != sequences["seq"].table:
            raise ValueError(
                f"data.schema.sequences 'negatives' must use the item table of 'seq' "
                f"({sequences['seq'].table!r}), not {negatives.table!r}"
            )

    def _check_pipeline(self, pipeline: PipelineConfig) -> None:
        num_blocks = getattr(self.model, "num_blocks", None)
        if not self.model.has_stages or num_blocks is None:
            raise ValueError(
                f"ps.pipeline needs a model with stages (sasrec, bst, hstu), got model.name {self.model.name!r}"
            )
        if pipeline.stages > num_blocks + 2:
            raise ValueError(
                f"ps.pipeline.stages={pipeline.stages} is more than the {num_blocks + 2} parts of the model "
                f"(embedding, model.num_blocks={num_blocks} blocks, head)"
            )
        if self.training.dense_precision == "bf16":
            raise ValueError(
                "ps.pipeline supports training.dense_precision fp32 only (auto resolves to fp32 there)"
            )
        if self.training.device == "cuda":
            raise ValueError("ps.pipeline trains on the CPU: set training.device to cpu (or auto)")

    def eviction_period(self) -> int | None:
        """Steps between evictions: the shortest `eviction.every_steps` of the tables that evict."""
        periods = []
        for table in self.table_names():
            eviction = self.table_config(table).eviction
            if eviction.ttl_steps is not None or eviction.max_rows is not None:
                periods.append(eviction.every_steps)
        return min(periods) if periods else None

    def fingerprint_dict(self) -> dict[str, Any]:
        """The parts of the config a checkpoint must agree with to be resumed (not steps or logging)."""
        data = self.model_dump(mode="json", by_alias=True)
        data["training"] = {
            k: v
            for k, v in data["training"].items()
            if k
            not in (
                "epochs",
                "max_steps",
                "log_every_steps",
                "eval_every_steps",
                "eval_every_epochs",
                "compile",
                "full_ranking",
                "device",  # a checkpoint holds CPU tensors: a run resumes on either device
                # how the dense model computes, not what a checkpoint holds (fp32 weights, optimizer
                # state and rows under either precision): a run resumes in the precision it resolves
                # to now, and the driver warns when that differs from the checkpoint's
                "dense_precision",
                # how a continuous run waits for its stream (the positions in the checkpoint say
                # where it stands): a resumed stream run may wait, cut batches and stop otherwise
                "stream",
            )
        }
        data.pop("run_dir")
        data.pop("checkpoint")
        data.pop("fault_tolerance")
        # embedding.*.storage may change: a checkpoint holds every row whatever tier it lived in
        embedding = data["embedding"]
        for table in [embedding["default"], *embedding["tables"].values()]:
            if table is not None:
                table.pop("storage", None)
        # ps.num_shards may change: a checkpoint restores into any shard count (psrec.ps.reshard);
        # so may ps.num_trainers under strategy "ps" without a pipeline: the rest of the epoch's
        # data is dealt to the new trainers (psrec.data.shares)
        kept = ["num_buckets", "strategy", "sharding", "pipeline"]
        if data["ps"]["strategy"] != "ps" or data["ps"]["pipeline"] is not None:
            kept.append("num_trainers")
        data["ps"] = {k: v for k, v in data["ps"].items() if k in kept}
        return data

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint_dict(), sort_keys=True).encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and what to do."""


def format_validation_error(source: str, error: ValidationError, *, what: str = "config") -> str:
    """One line per invalid field: its dotted path and what is wrong."""
    lines = [f"{source}: invalid {what}"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"  {location}: {item['msg']}")
    return "\n".join(lines)


def parse_config(
    data: dict[str, Any], *, source: str = "<config>", overrides: dict[str, Any] | None = None
) -> RunConfig:
    """Validate a config dict; `overrides` maps dotted paths to values (e.g. {"ps.runtime": "local"})."""
    try:
        return RunConfig.model_validate(apply_overrides(data, overrides))
    except ValidationError as error:
        raise ConfigError(format_validation_error(source, error)) from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of `data` with each dotted path of `overrides` set (missing parents created)."""
    data = copy.deepcopy(data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def load_config(path: str | Path, *, overrides: dict[str, Any] | None = None) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping at the top level")
    return parse_config(data, source=str(path), overrides=overrides)


def normalized_fingerprint(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config re-validated with today's schema: new fields appear at their defaults."""
    try:
        return RunConfig.model_validate(saved).fingerprint_dict()
    except ValidationError:
        return saved  # not valid any more: compared as written, the differences are then reported
