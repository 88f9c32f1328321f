"""Avro stream messages: records of a given schema decode to the rows a file (or JSON) of them gives.

The oracles are not the Avro path: rows are encoded with fastavro's own writer (`schemaless_writer`)
and the decoded batch is compared with the file reader's batch of the same rows written as CSV, or
with the JSON messages' decoding; through the real test broker (`kafka_broker`), an Avro topic gives
the batches of the same rows sent as JSON. Bad messages raise naming topic, partition and offset,
or are counted and skipped; the source's Avro settings are validated naming the field.
"""

from __future__ import annotations

import io
import json
import random
import struct
import uuid
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from psrec.config import ConfigError, parse_config
from psrec.data.batch import Batch
from psrec.data.errors import BadRowError, BadRows
from psrec.data.features import ROW_ID, prepare_table, table_to_batch
from psrec.data.kafka_source import KafkaSource, open_kafka_reader
from psrec.data.message_format import AvroMessages, MessageDecoder, check_avro_columns
from psrec.data.reader import open_reader
from psrec.data.schema import (
    DataSource,
    DenseFeature,
    Schema,
    SequenceFeature,
    SparseFeature,
    load_avro_schema,
)
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.testing.kafka_broker import KafkaBroker

CLIENT = {"fetch.wait.max.ms": 20}
SCHEMA = Schema(
    label="click",
    dense=[DenseFeature(name="price", log1p=True), DenseFeature(name="ratio")],
    sparse=[
        SparseFeature(name="user", table="users"),
        SparseFeature(name="tags", table="tags", multi_valued=True),
        SparseFeature(name="kind", table="kinds"),
        SparseFeature(name="slot", table="slots", hashed=False),
    ],
    sequences=[SequenceFeature(name="history", table="items", max_length=4)],
)
AVRO_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Click",
    "namespace": "test.psrec",
    "fields": [
        {"name": "click", "type": "int"},
        {"name": "price", "type": ["null", "double"]},
        {"name": "ratio", "type": ["null", "float"]},
        {"name": "user", "type": ["null", "string", "long"]},
        {"name": "tags", "type": {"type": "array", "items": ["string", "long"]}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["ad", "organic", "promo"]}},
        {"name": "slot", "type": "long"},
        {"name": "history", "type": ["null", {"type": "array", "items": "long"}]},
        {"name": "note", "type": {"type": "map", "values": "string"}},  # a field no column reads
    ],
}
CRITEO_NAMES = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
CRITEO_AVRO: dict[str, Any] = {
    "type": "record",
    "name": "Criteo",
    "fields": [
        {"name": "label", "type": "int"},
        *({"name": f"I{i}", "type": ["null", "long"]} for i in range(1, 14)),
        *({"name": f"C{i}", "type": ["null", "string"]} for i in range(1, 27)),
    ],
}


def _rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of `SCHEMA` with nulls, empty lists, text and integer ids, exact float32 ratios."""
    generator = random.Random(seed)
    rows = []
    for index in range(count):
        user: str | int | None = generator.choice(
            [None, f"u{generator.randrange(50)}", generator.randrange(50)]
        )
        rows.append(
            {
                "click": generator.randrange(2),
                "price": generator.choice([None, round(generator.uniform(0, 100), 3)]),
                "ratio": generator.choice([None, generator.randrange(-64, 64) / 8]),
                "user": user,
                "tags": [
                    generator.choice([f"t{generator.randrange(9)}", generator.randrange(9)])
                    for _ in range(index % 4)
                ],
                "kind": generator.choice(["ad", "organic", "promo"]),
                "slot": generator.choice([0, generator.randrange(1 << 47)]),
                "history": generator.choice([None, [generator.randrange(1000) for _ in range(index % 6)]]),
                "note": {"source": "test"},
            }
        )
    return rows


def _avro(row: dict[str, Any], schema: dict[str, Any] = AVRO_SCHEMA, schema_id: int | None = None) -> bytes:
    """A row as fastavro writes it: the bare record, or (with `schema_id`) in the Confluent wire format."""
    stream = io.BytesIO()
    if schema_id is not None:
        stream.write(b"\x00" + struct.pack(">I", schema_id))
    fastavro.schemaless_writer(stream, fastavro.parse_schema(schema), row)
    return stream.getvalue()


def _csv_batch(tmp_path: Path, rows: list[dict[str, Any]]) -> Batch:
    """The file reader's batch of `rows` written as a CSV file (lists joined with "|", null empty)."""

    def text(value: Any) -> str:
        if value is None:
            return ""
        return "|".join(str(item) for item in value) if isinstance(value, list) else str(value)

    names = [*SCHEMA.label_names, *SCHEMA.feature_names]
    lines = [",".join(names)] + [",".join(text(row[name]) for name in names) for row in rows]
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    source = DataSource(format="csv", paths=[str(tmp_path / "rows.csv")])
    with open_reader(source, SCHEMA, batch_size=len(rows), prefetch=0) as reader:
        (batch,) = list(reader)
    return batch


def _locate(index: int) -> tuple[str, str]:
    return "topic 'clicks' partition 3", f"offset {100 + index}"


def _decode(decoder: MessageDecoder, messages: list[bytes]) -> tuple[pa.Table | None, np.ndarray]:
    return decoder.decode(messages, np.arange(len(messages), dtype=np.int64), _locate)


def _batch(schema: Schema, table: pa.Table | None) -> Batch:
    assert table is not None
    return table_to_batch(schema, prepare_table(schema, table))


def _assert_same_rows(got: Batch, expected: Batch) -> None:
    np.testing.assert_array_equal(got.labels, expected.labels)
    np.testing.assert_array_equal(got.dense, expected.dense)
    assert got.sparse.keys == expected.sparse.keys
    np.testing.assert_array_equal(got.sparse.ids, expected.sparse.ids)
    np.testing.assert_array_equal(got.sparse.lengths, expected.sparse.lengths)
    assert got.sequences.keys() == expected.sequences.keys()
    for name, sequence in got.sequences.items():
        np.testing.assert_array_equal(sequence.ids, expected.sequences[name].ids)
        np.testing.assert_array_equal(sequence.mask, expected.sequences[name].mask)


def test_avro_records_give_the_file_readers_rows(tmp_path: Path) -> None:
    """Plain and Confluent-framed records give the batch of a CSV file of the same rows, and the
    table of the same rows sent as JSON objects."""
    rows = _rows(300)
    expected = _csv_batch(tmp_path, rows)
    json_decoder = MessageDecoder(SCHEMA, "json", BadRows("raise"))
    json_table, _ = _decode(json_decoder, [json.dumps(row).encode() for row in rows])
    for framing, schema_id in (("plain", None), ("confluent", 7)):
        avro = AvroMessages(load_avro_schema(AVRO_SCHEMA), framing=framing, schema_id=schema_id)  # type: ignore[arg-type]
        decoder = MessageDecoder(SCHEMA, "avro", BadRows("raise"), avro=avro)
        table, kept = _decode(decoder, [_avro(row, schema_id=schema_id) for row in rows])
        assert table is not None and json_table is not None
        assert table.equals(json_table), framing
        np.testing.assert_array_equal(kept, np.arange(len(rows)))
        np.testing.assert_array_equal(table.column(ROW_ID).to_numpy(), np.arange(len(rows)))
        _assert_same_rows(_batch(SCHEMA, table), expected)


def test_criteo_records_give_the_tsv_readers_rows(tmp_path: Path) -> None:
    (path,) = write_synthetic_criteo(tmp_path, rows=400, seed=2, format="tsv", cardinality_scale=0.001)
    lines = path.read_text().splitlines()
    rows = [
        {
            name: (None if text == "" else text if name.startswith("C") else int(text))
            for name, text in zip(CRITEO_NAMES, line.split("\t"), strict=True)
        }
        for line in lines
    ]
    schema = criteo_schema()
    with open_reader(DataSource(format="criteo_tsv", paths=[str(path)]), schema, batch_size=400) as reader:
        (expected,) = list(reader)
    decoder = MessageDecoder(schema, "avro", BadRows("raise"), avro=AvroMessages(CRITEO_AVRO, "plain"))
    table, _ = _decode(decoder, [_avro(row, CRITEO_AVRO) for row in rows])
    _assert_same_rows(_batch(schema, table), expected)


KIND_AS_INT = {  # another writer's schema: "kind" an int, so the reader finds an enum index out of range
    **AVRO_SCHEMA,
    "fields": [{"name": "kind", "type": "int"} if f["name"] == "kind" else f for f in AVRO_SCHEMA["fields"]],
}
GOOD = {
    "click": 1,
    "price": 2.5,
    "ratio": 0.5,
    "user": "u1",
    "tags": ["a"],
    "kind": "ad",
    "slot": 3,
    "history": [1, 2],
    "note": {},
}
BAD_CONFLUENT = [
    (_avro(GOOD, schema_id=7)[:-3], "not an Avro record of the schema: EOFError"),  # truncated
    (_avro(GOOD, schema_id=7) + b"\x02", "1 byte(s) after the Avro record"),
    (_avro(GOOD), "first byte 0x02 is not the Confluent wire format's magic byte 0"),  # bare record
    (b"\x00\x00\x07", "3 byte(s): shorter than the Confluent wire format's 5-byte header"),
    (b"", "an empty message"),
    (_avro(GOOD, schema_id=8), "written with schema id 8, not the source's avro_schema_id 7"),
    (_avro({**GOOD, "click": 2}, schema_id=7), "label 'click' is 2: expected 0 or 1"),
    (_avro({**GOOD, "kind": 6}, KIND_AS_INT, schema_id=7), "IndexError"),  # enum symbol 6 of 3
]


def test_bad_messages_raise_naming_the_place_or_are_counted() -> None:
    """Each bad message among good ones raises naming its place and reason, or is skipped and
    counted (the good ones kept)."""
    avro = AvroMessages(AVRO_SCHEMA, "confluent", schema_id=7)
    good = _avro(GOOD, schema_id=7)
    for number, (bad, reason) in enumerate(BAD_CONFLUENT):
        decoder = MessageDecoder(SCHEMA, "avro", BadRows("raise"), avro=avro)
        with pytest.raises(BadRowError) as caught:
            _decode(decoder, [good, bad, good])
        error = caught.value
        assert (error.path, error.location) == ("topic 'clicks' partition 3", "offset 101"), number
        assert reason in error.reason, (number, error.reason)
    errors = BadRows("skip")
    decoder = MessageDecoder(SCHEMA, "avro", errors, avro=avro)
    messages = [message for bad, _ in BAD_CONFLUENT for message in (good, bad)]
    table, kept = _decode(decoder, messages)
    assert table is not None and table.num_rows == len(BAD_CONFLUENT)
    np.testing.assert_array_equal(kept, np.arange(0, len(messages), 2))
    assert errors.tally.rows_skipped == len(BAD_CONFLUENT)
    samples = errors.tally.samples
    assert [sample.location for sample in samples] == [
        f"offset {101 + 2 * i}" for i in range(len(BAD_CONFLUENT))
    ]
    assert samples[0].text == BAD_CONFLUENT[0][0].hex()  # binary messages are shown as hex

    # A null label is a missing one, as in a JSON object or a file.
    nullable = {
        **AVRO_SCHEMA,
        "fields": [{"name": "click", "type": ["null", "int"]}, *AVRO_SCHEMA["fields"][1:]],
    }
    plain = MessageDecoder(SCHEMA, "avro", BadRows("raise"), avro=AvroMessages(nullable, "plain"))
    assert _decode(plain, [_avro(GOOD, nullable)])[0] is not None
    with pytest.raises(BadRowError, match="missing label 'click'"):
        _decode(plain, [_avro({**GOOD, "click": None}, nullable)])


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ({"name": "price", "type": "string"}, ["'price' is of type string", "int, long, float or double"]),
        ({"name": "click", "type": "boolean"}, ["'click' is of type boolean"]),
        ({"name": "slot", "type": ["null", "double"]}, ["'slot' is of type double", "int or long"]),
        (
            {"name": "tags", "type": {"type": "array", "items": "double"}},
            ["'tags' is of type array of double"],
        ),
        (
            {"name": "price", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            ["'price' is of type long/timestamp-millis", "no logical types"],
        ),
        ({"name": "user", "type": {"type": "string", "logicalType": "uuid"}}, ["string/uuid"]),
    ],
)
def test_a_schema_that_cannot_fill_the_columns_is_refused(field: dict[str, Any], words: list[str]) -> None:
    fields = [field if existing["name"] == field["name"] else existing for existing in AVRO_SCHEMA["fields"]]
    with pytest.raises(ValueError) as caught:
        check_avro_columns(SCHEMA, {**AVRO_SCHEMA, "fields": fields})
    for word in words:
        assert word in str(caught.value), str(caught.value)
    without = {
        **AVRO_SCHEMA,
        "fields": [f for f in AVRO_SCHEMA["fields"] if f["name"] not in ("kind", "ratio")],
    }
    with pytest.raises(ValueError, match=r"has no fields \['ratio', 'kind'\]"):
        MessageDecoder(SCHEMA, "avro", BadRows("raise"), avro=AvroMessages(without))


def test_the_source_validates_its_avro_settings_naming_the_field(tmp_path: Path) -> None:
    base = {"bootstrap_servers": "127.0.0.1:1", "topics": ["t"], "message_format": "avro"}
    (tmp_path / "click.avsc").write_text(json.dumps(AVRO_SCHEMA))
    from_file = KafkaSource(**base, avro_schema=str(tmp_path / "click.avsc"))
    from_text = KafkaSource(**base, avro_schema=json.dumps(AVRO_SCHEMA))
    assert from_file.avro_schema == from_text.avro_schema == AVRO_SCHEMA  # the source holds the schema
    assert KafkaSource(**from_file.model_dump()) == from_file  # a dumped source validates again
    json_source = KafkaSource(bootstrap_servers="127.0.0.1:1", topics=["t"])
    assert KafkaSource(**json_source.model_dump()) == json_source
    for settings, field, words in (
        ({"avro_schema": str(tmp_path / "absent.avsc")}, "avro_schema", ["cannot read the Avro schema file"]),
        ({"avro_schema": "{not json"}, "avro_schema", ["not valid JSON"]),
        (
            {"avro_schema": {"type": "enum", "name": "E", "symbols": ["a"]}},
            "avro_schema",
            ["'record'", "'enum'"],
        ),
        (
            {"avro_schema": {"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]}},
            "avro_schema",
            ["not a valid Avro schema", "nope"],
        ),
        ({}, None, ["message_format avro needs avro_schema"]),
        ({"avro_schema": AVRO_SCHEMA, "columns": ["click"]}, None, ["csv/tsv messages, not avro"]),
        (
            {"avro_schema": AVRO_SCHEMA, "avro_framing": "plain", "avro_schema_id": 3},
            None,
            ["plain records carry none"],
        ),
        ({"avro_schema": AVRO_SCHEMA, "avro_framing": "json"}, "avro_framing", ["'confluent'"]),
        (
            {"avro_schema": AVRO_SCHEMA, "message_format": "json"},
            None,
            ["avro_schema apply to avro messages, not json"],
        ),
    ):
        with pytest.raises(ValidationError) as caught:
            KafkaSource(**{**base, **settings})
        (error,) = caught.value.errors()
        assert error["loc"] == ((field,) if field else ()), (settings, error)
        for word in words:
            assert word in error["msg"], (settings, error["msg"])

    config = {
        "run_dir": str(tmp_path),
        "data": {
            "schema": SCHEMA.model_dump(),
            "train": {"format": "kafka", **base, "avro_schema": "x.avsc"},
        },
        "model": {"name": "dlrm", "bottom_hidden_sizes": [16], "top_hidden_sizes": [16, 8]},
        "embedding": {"default": {"dim": 4}},
    }
    with pytest.raises(
        ConfigError, match=r"data\.train\.kafka\.avro_schema: .*cannot read the Avro schema file 'x\.avsc'"
    ):
        parse_config(config)


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _stream(broker: KafkaBroker, topic: str, message_format: str, **options: Any) -> list[Batch]:
    source = KafkaSource(
        bootstrap_servers=broker.bootstrap_servers,
        topics=[topic],
        message_format=message_format,
        client=CLIENT,
        poll_timeout_s=0.1,
        **options,
    )
    with open_kafka_reader(source, SCHEMA, batch_size=64, until="end") as reader:
        return list(reader)


def test_an_avro_topic_gives_the_batches_of_the_same_json_topic(kafka_broker: KafkaBroker) -> None:
    """Confluent-framed records through the real broker make the batches the same rows make as JSON
    objects; a bad record among them raises naming its offset, or is skipped and counted."""
    rows = _rows(300, seed=1)
    topics = {name: _topic(f"avro-{name}") for name in ("avro", "json", "bad")}
    for topic in topics.values():
        kafka_broker.create_topic(topic, partitions=1)
    kafka_broker.produce(topics["avro"], [(0, _avro(row, schema_id=1)) for row in rows])
    kafka_broker.produce(topics["json"], [(0, json.dumps(row).encode()) for row in rows])
    options = {"avro_schema": AVRO_SCHEMA, "avro_schema_id": 1}
    avro_batches = _stream(kafka_broker, topics["avro"], "avro", **options)
    json_batches = _stream(kafka_broker, topics["json"], "json")
    assert [batch.batch_size for batch in avro_batches] == [64, 64, 64, 64, 44]
    assert len(avro_batches) == len(json_batches)
    for got, expected in zip(avro_batches, json_batches, strict=True):
        _assert_same_rows(got, expected)
        np.testing.assert_array_equal(got.row_ids, expected.row_ids)

    messages = [_avro(row, schema_id=1) for row in rows[:6]]
    messages[3] = messages[3][:-2]
    kafka_broker.produce(topics["bad"], [(0, message) for message in messages])
    with pytest.raises(BadRowError) as caught:
        _stream(kafka_broker, topics["bad"], "avro", **options)
    assert (caught.value.path, caught.value.location) == (f"topic {topics['bad']!r} partition 0", "offset 3")
    assert "EOFError" in caught.value.reason and "on_error: skip" in caught.value.reason
    skipped = _stream(kafka_broker, topics["bad"], "avro", on_error="skip", **options)
    row_ids = np.concatenate([batch.row_ids for batch in skipped])
    assert row_ids.tolist() == [0, 1, 2, 4, 5]
