"""What a dataset looks like: the feature schema and the data source, as validated pydantic models.

Both models are embedded in the run config, so they validate once at the boundary with clear
messages (`extra="forbid"`: a misspelt key is an error, not a silently ignored option).

Example (YAML, as it appears in a run config)::

    schema:
      label: label
      dense: [{name: I1, log1p: true}, {name: I2, log1p: true, clip: [0, 1e6]}]
      sparse:
        - {name: C1, table: C1}
        - {name: item, table: items, namespace: item}
        - {name: tags, table: tags, multi_valued: true, separator: "|"}
      sequences:
        - {name: history, table: items, max_length: 50, namespace: item}
    source:
      format: criteo_tsv
      paths: ["day_*.tsv.gz"]
      on_error: skip

Labels are binary: every model trains on them with binary cross-entropy, so a label must be 0 or 1
(libfm's -1 is read as 0); any other value, NaN included, makes the row a bad row (`on_error`).

Transforms of a dense feature apply in this order: missing (empty, null) -> `fill`; a value that is
not a finite float32 (text "nan"/"inf", a NaN or infinity in Parquet, a number beyond +-3.4e38) ->
as `invalid` says: "fill" (the default: NaN and infinities -> `fill`, numbers beyond float32's range
-> the nearest float32; both counted in the reader's stats), "skip" (the row is skipped and counted)
or "raise" (the row raises, naming file, line and feature); then `clip` to [low, high]; then `log1p`,
which first clamps negatives to 0 (Criteo's -1 counts become 0, as in DLRM's preprocessing).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from psrec.data.namespaces import namespace_tag
from psrec.data.units import OFFSET_BITS

CRITEO_LABEL = "label"
CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))
CRITEO_COLUMNS = (CRITEO_LABEL, *CRITEO_DENSE, *CRITEO_SPARSE)

DEFAULT_SPLIT_BYTES = 64 * 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DenseFeature(_Strict):
    """A float feature: missing values are filled, values that are not finite float32 numbers handled
    as `invalid` says, then clipped, then optionally log1p-transformed (see the module docstring)."""

    name: str = Field(min_length=1)
    fill: float = 0.0
    log1p: bool = False
    clip: tuple[float, float] | None = None
    invalid: Literal["fill", "skip", "raise"] = "fill"

    @field_validator("fill")
    @classmethod
    def _fill_finite(cls, value: float) -> float:
        if not abs(value) <= float(np.finfo(np.float32).max):
            raise ValueError(f"fill must be a finite float32 number, got {value}")
        return value

    @field_validator("clip")
    @classmethod
    def _clip_ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and value[0] > value[1]:
            raise ValueError(f"clip low {value[0]} is above clip high {value[1]}")
        return value


class SparseFeature(_Strict):
    """A categorical feature mapped to embedding table `table`.

    `hashed=True` maps each raw value (text or integer) to a 64-bit id with `hash_values(namespace,
    ...)`; `hashed=False` passes integer ids through (they must lie in [0, 2**48)). Features that must
    share ids (a target item and the item history) use the same `namespace`; it defaults to the
    feature name. A single-valued feature always has one id per row (a missing value hashes like the
    empty string); a multi-valued one splits its text on `separator` and may have zero ids.
    """

    name: str = Field(min_length=1)
    table: str = Field(min_length=1)
    multi_valued: bool = False
    separator: str = Field(default="|", min_length=1)
    hashed: bool = True
    namespace: str | None = None

    @property
    def id_namespace(self) -> str:
        return self.namespace or self.name


class SequenceFeature(_Strict):
    """An ordered id list (oldest first), kept to its last `max_length` ids, padded on the left.

    In tabular formats the column holds a list or `separator`-joined text; ids are hashed in
    `namespace` (default: the feature name) unless `hashed=False`.
    """

    name: str = Field(min_length=1)
    table: str = Field(min_length=1)
    max_length: int = Field(gt=0)
    namespace: str | None = None
    hashed: bool = True
    separator: str = Field(default="|", min_length=1)

    @property
    def id_namespace(self) -> str:
        return self.namespace or self.name


class Schema(_Strict):
    """Label column(s) and the features read from each row, in the order batches carry them."""

    label: str | list[str]
    dense: list[DenseFeature] = []
    sparse: list[SparseFeature] = []
    sequences: list[SequenceFeature] = []

    @property
    def label_names(self) -> list[str]:
        return [self.label] if isinstance(self.label, str) else list(self.label)

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.dense] + [f.name for f in self.sparse] + [f.name for f in self.sequences]

    @model_validator(mode="after")
    def _check(self) -> Schema:
        if not self.label_names:
            raise ValueError("label: at least one label column is required")
        names = self.label_names + self.feature_names
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"column names used twice (labels and features must be distinct): {duplicates}")
        # Hashed ids of different namespaces differ in their top bits by construction; two namespaces
        # sharing a table must therefore have different tags (a 1-in-32767 chance per pair).
        tags: dict[tuple[str, int], str] = {}
        features: list[SparseFeature | SequenceFeature] = [*self.sparse, *self.sequences]
        for feature in features:
            if not feature.hashed:
                continue
            namespace = feature.id_namespace
            key = (feature.table, namespace_tag(namespace))
            other = tags.setdefault(key, namespace)
            if other != namespace:
                raise ValueError(
                    f"namespaces {other!r} and {namespace!r} share table {feature.table!r} and the same "
                    f"15-bit namespace tag {key[1]}; rename one of them"
                )
        return self


Order = Literal["name", "time"]


class GrowingFiles(_Strict):
    """How a growing directory or prefix is followed (`psrec.data.growing_source`; `DataSource.growing`).

    - `order`: "name" (lexicographic, for ``dt=.../hour=.../part-N`` layouts) or "time"
      (modification time, ties by name).
    - `poll_seconds`: how often the paths are listed again.
    - `settle_seconds`: a file is read once its size and modification time stayed the same this
      long; 0 for stores and writers that publish a file whole (object stores, write-then-rename).
    - `lateness_seconds`: how far back (modification time before the newest file read) a file that
      lands late, while no reader runs, is still recognised as not read; the position lists the
      files read within this window, so it grows with the files landing in it.
    - `ignore_prefixes`: files and directories whose name starts with one of these are not data.
    """

    order: Order = "name"
    poll_seconds: float = Field(default=1.0, gt=0)
    settle_seconds: float = Field(default=0.0, ge=0)
    lateness_seconds: float = Field(default=3600.0, ge=0)
    ignore_prefixes: list[str] = Field(default=[".", "_"])


class DataSource(_Strict):
    """Where rows come from: format, files (paths or globs) and format options.

    Relative paths are resolved against the base directory given to `open_reader`; `.gz` files
    (detected by their magic bytes) are decompressed on the fly. Options:

    - `delimiter`, `header`, `columns` (csv / criteo_tsv): the column separator (csv ","; criteo_tsv
      tab), whether the first line names the columns (csv yes; criteo_tsv no), and the column names
      when there is no header (criteo_tsv: label, I1..I13, C1..C26).
    - `field_ranges` (libfm, required): field name -> [first, last] feature id (inclusive); each
      `id:value` token belongs to the field whose range holds its id.
    - `split_bytes` (text formats): uncompressed text files are cut into byte ranges of this size,
      the unit of sharding and resume (a gzip file is one unit). Parquet's unit is the row group.
    - `on_error`: "raise" stops at the first malformed row with file, line and text; "skip" counts
      it, logs a sample and goes on (see `BatchReader.stats()`). A unit that cannot be read to its
      end (a file cut short, corrupt or unreadable) raises, or is counted apart (`units_failed`,
      `bytes_lost`), named in a warning, and the rows before the damage are kept.
    - `allow_empty`: a file without rows (empty, or only a header or blank lines) is an error
      unless this is true.
    - `growing`: the paths are a directory or prefix where new files keep landing; a continuous
      run (`training.mode: continuous`) reads each once, as it lands (`GrowingFiles`).
    - `holdout` (interactions): which items each user's sequence holds out for evaluation:
      "last_two" (SASRec's split: validation = second-to-last, test = last) or "last"
      (generative-recommenders': train on all but the last item, evaluate on the last); see
      `psrec.data.sequences`.
    - `negatives_from` (interactions with a "negatives" sequence, the sampled softmax's draws):
      "unseen" draws them uniformly from the items the user never trained on; "all" uniformly from
      all items, as generative-recommenders does (a draw that is a position's own next item is then
      masked by the loss; see `psrec.models.sasrec.negatives_logits`).
    """

    format: Literal["criteo_tsv", "csv", "libfm", "parquet", "interactions"]
    paths: list[str] = Field(min_length=1)
    delimiter: str | None = Field(default=None, min_length=1, max_length=1)
    header: bool | None = None
    columns: list[str] | None = None
    field_ranges: dict[str, tuple[int, int]] | None = None
    split_bytes: int = Field(default=DEFAULT_SPLIT_BYTES, gt=0)
    on_error: Literal["raise", "skip"] = "raise"
    allow_empty: bool = False
    growing: GrowingFiles | None = None
    holdout: Literal["last_two", "last"] = "last_two"
    negatives_from: Literal["unseen", "all"] = "unseen"

    @model_validator(mode="after")
    def _check(self) -> DataSource:
        if self.format == "libfm":
            if not self.field_ranges:
                raise ValueError("format 'libfm' needs field_ranges: {field: [first_id, last_id], ...}")
            ranges = sorted((low, high, name) for name, (low, high) in self.field_ranges.items())
            for low, high, name in ranges:
                if low > high or low < 0:
                    raise ValueError(f"field_ranges.{name}: [{low}, {high}] is not a valid id range")
            for (_, high, name), (low, _, next_name) in zip(ranges, ranges[1:], strict=False):
                if low <= high:
                    raise ValueError(f"field_ranges: {name!r} and {next_name!r} overlap")
        elif self.field_ranges is not None:
            raise ValueError(f"field_ranges applies to format 'libfm' only, not {self.format!r}")
        if self.format not in ("csv", "criteo_tsv") and (
            self.delimiter is not None or self.header is not None or self.columns is not None
        ):
            raise ValueError(f"delimiter/header/columns apply to csv and criteo_tsv, not {self.format!r}")
        if self.holdout != "last_two" and self.format != "interactions":
            raise ValueError(f"holdout applies to format 'interactions' only, not {self.format!r}")
        if self.negatives_from != "unseen" and self.format != "interactions":
            raise ValueError(f"negatives_from applies to format 'interactions' only, not {self.format!r}")
        if self.format == "csv" and self.header is False and not self.columns:
            raise ValueError("csv without a header needs `columns` (the column names in file order)")
        return self

    @property
    def text_delimiter(self) -> str:
        return self.delimiter or ("\t" if self.format == "criteo_tsv" else ",")

    @property
    def has_header(self) -> bool:
        return self.header if self.header is not None else self.format == "csv"

    @property
    def column_names(self) -> list[str] | None:
        if self.columns is not None:
            return list(self.columns)
        return list(CRITEO_COLUMNS) if self.format == "criteo_tsv" else None


# Kafka row ids: ((topic_index << PARTITION_BITS) | partition) << OFFSET_BITS | offset (psrec.data.kafka_source)
PARTITION_BITS = 16
MAX_TOPICS = 1 << (63 - OFFSET_BITS - PARTITION_BITS)  # row ids stay non-negative int64
MessageFormat = Literal["json", "csv", "tsv", "avro"]
AvroFraming = Literal["confluent", "plain"]


def load_avro_schema(value: Mapping[str, Any] | str) -> dict[str, Any]:
    """An Avro record schema, checked (fastavro parses it, its type is "record"), as a plain JSON
    mapping: `value` is the schema itself, its JSON text, or the path of an .avsc file holding it."""
    import fastavro  # here, not at the top: only Avro sources pay for its import

    if isinstance(value, str):
        text = value
        if not value.lstrip().startswith("{"):
            try:
                text = Path(value).read_text()
            except OSError as error:
                raise ValueError(
                    f"cannot read the Avro schema file {value!r}: {error.strerror} (give a path to an "
                    ".avsc file, or the schema itself as a JSON object)"
                ) from None
        try:
            value = json.loads(text)
        except ValueError as error:
            raise ValueError(f"the Avro schema is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"an Avro record schema (a JSON object) expected, got {type(value).__name__}")
    schema = json.loads(json.dumps(value))  # a plain copy; fails on what JSON cannot hold
    if schema.get("type") != "record":
        raise ValueError(f"an Avro schema of type 'record' expected, got type {schema.get('type')!r}")
    try:
        fastavro.parse_schema(schema)
    except Exception as error:  # noqa: BLE001 - fastavro raises several types for a bad schema
        raise ValueError(f"not a valid Avro schema: {type(error).__name__}: {error}") from None
    return dict(schema)


class KafkaSource(_Strict):
    """Where the stream comes from and how its messages read (validated like `DataSource`; in a run
    config it is `data.train` with `format: kafka`, see docs/streaming.md).

    `client`: more librdkafka settings (security, SASL, fetch sizes, `group.id`); psrec sets
    `enable.auto.commit: false` and explicit offsets whatever they say. `columns` and `delimiter`
    apply to csv/tsv messages (see `psrec.data.message_format`; read by `psrec.data.kafka_source`). `poll_timeout_s`: the longest one
    poll of the broker waits (also how soon a closed reader notices).

    Avro messages (`message_format: avro`) need `avro_schema`, their record schema: the schema as a
    mapping, its JSON text, or the path of an .avsc file, which is read when the source is
    validated (the source then holds the schema itself, so trainers elsewhere need no file).
    `avro_framing`: "confluent" (default; magic byte 0 and a 4-byte schema id before each record,
    as Confluent's serializers write) or "plain" (bare records). `avro_schema_id`: with the
    Confluent framing, the one schema id accepted (a message of another is a bad row); the id is
    never looked up in a schema registry: `avro_schema` reads every message.
    """

    format: Literal["kafka"] = "kafka"  # tells it from a file `DataSource` in a run config's data.train
    bootstrap_servers: str = Field(min_length=1)
    topics: list[str] = Field(min_length=1, max_length=MAX_TOPICS)
    message_format: MessageFormat = "json"
    columns: list[str] | None = None
    delimiter: str | None = Field(default=None, min_length=1, max_length=1)
    avro_schema: dict[str, Any] | None = None
    avro_framing: AvroFraming = "confluent"
    avro_schema_id: int | None = Field(default=None, ge=0, lt=1 << 32)
    on_error: Literal["raise", "skip"] = "raise"
    client: dict[str, str | int | float | bool] = {}
    poll_timeout_s: float = Field(default=0.5, gt=0)

    @field_validator("avro_schema", mode="before")
    @classmethod
    def _load_avro_schema(cls, value: Any) -> Any:
        return value if value is None or not isinstance(value, dict | str) else load_avro_schema(value)

    @model_validator(mode="after")
    def _check(self) -> KafkaSource:
        if len(set(self.topics)) != len(self.topics):
            raise ValueError(f"topics named twice: {self.topics}")
        text = self.message_format in ("csv", "tsv")
        if not text and (self.columns is not None or self.delimiter is not None):
            raise ValueError(f"columns and delimiter apply to csv/tsv messages, not {self.message_format}")
        avro = self.message_format == "avro"
        if avro and self.avro_schema is None:
            raise ValueError(
                "message_format avro needs avro_schema: the record schema (a mapping, its JSON text, "
                "or the path of an .avsc file)"
            )
        changed = {  # from their defaults (a dumped source holds every field, set or not)
            "avro_schema": self.avro_schema is not None,
            "avro_framing": self.avro_framing != "confluent",
            "avro_schema_id": self.avro_schema_id is not None,
        }
        given = [name for name, differs in changed.items() if differs]
        if not avro and given:
            raise ValueError(f"{', '.join(given)} apply to avro messages, not {self.message_format}")
        if self.avro_schema_id is not None and self.avro_framing != "confluent":
            raise ValueError("avro_schema_id is the Confluent framing's schema id: plain records carry none")
        return self
