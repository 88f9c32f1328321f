"""The Kafka stream source against a real broker (Tansu on 127.0.0.1, `kafka_broker` fixture).

The oracle is psrec's file reader: the rows produced into a topic, written as a file in the same
order, give the same batches (hashed ids, dense values, labels) through `open_reader` as the topic
through `open_kafka_reader`; a position resumes with exactly the rows not delivered yet, also after
the broker was killed; bad messages raise or are counted like bad file rows.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.data.batch import Batch, concat_batches
from psrec.data.errors import BadRowError
from psrec.data.kafka_source import (
    KafkaSource,
    kafka_position,
    open_kafka_reader,
    partitions_for,
    position_offsets,
    row_id_slot,
    topic_partitions,
)
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SparseFeature
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.data.units import OFFSET_BITS, OFFSET_MASK
from psrec.testing.kafka_broker import KafkaBroker
from tests.conftest import is_loopback, listening_sockets

ROWS = 600
# Short broker waits: a fetch at a partition's end returns (and says so) after 20 ms, not 500.
CLIENT = {"fetch.wait.max.ms": 20}


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _source(broker: KafkaBroker, topic: str, message_format: str = "tsv", **options: Any) -> KafkaSource:
    settings: dict[str, Any] = {"client": CLIENT, "poll_timeout_s": 0.1, **options}
    return KafkaSource(
        bootstrap_servers=broker.bootstrap_servers,
        topics=[topic],
        message_format=message_format,  # type: ignore[arg-type]
        **settings,
    )


def _read(source: KafkaSource, schema: Schema, **options: Any) -> list[Batch]:
    with open_kafka_reader(source, schema, **options) as reader:
        return list(reader)


@pytest.fixture(scope="module")
def criteo_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """ROWS synthetic Criteo rows as raw TSV lines (some values missing)."""
    directory = tmp_path_factory.mktemp("kafka_rows")
    (path,) = write_synthetic_criteo(directory, rows=ROWS, seed=5, format="tsv", cardinality_scale=0.001)
    return path.read_text().splitlines()


def _partition_of(count: int) -> np.ndarray:
    """A fixed, uneven interleaving of rows over two partitions."""
    return np.random.default_rng(3).integers(0, 2, size=count)


def _file_batches(tmp_path: Path, name: str, lines: list[str], schema: Schema, **options: Any) -> list[Batch]:
    path = tmp_path / f"{name}.tsv"
    path.write_text("".join(f"{line}\n" for line in lines))
    source = DataSource(format="criteo_tsv", paths=[str(path)])
    with open_reader(source, schema, prefetch=0, **options) as reader:
        return list(reader)


def _assert_same_rows(stream: Batch, file: Batch) -> None:
    """The same rows: labels, dense values, sparse keys, ids and lengths (row ids differ by source)."""
    np.testing.assert_array_equal(stream.labels, file.labels)
    np.testing.assert_array_equal(stream.dense, file.dense)
    assert stream.sparse.keys == file.sparse.keys
    np.testing.assert_array_equal(stream.sparse.ids, file.sparse.ids)
    np.testing.assert_array_equal(stream.sparse.lengths, file.sparse.lengths)


def _json_row(line: str) -> bytes:
    """A Criteo TSV line as the JSON object a producer would send: numbers as numbers, missing
    values absent or null (alternately), ids as text."""
    names = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    row: dict[str, Any] = {}
    for index, (name, text) in enumerate(zip(names, line.split("\t"), strict=True)):
        if text == "":
            if index % 2:
                row[name] = None
            continue
        row[name] = text if name.startswith("C") else int(text)
    return json.dumps(row).encode()


def _partition(batch: Batch) -> np.ndarray:
    assert batch.row_ids is not None
    return (batch.row_ids >> OFFSET_BITS) & 0xFFFF


def test_partitions_are_dealt_to_trainers_once() -> None:
    partitions = [("b", 1), ("a", 0), ("b", 0), ("a", 2), ("a", 1)]
    shares = [partitions_for(trainer, 2, partitions) for trainer in range(2)]
    assert shares == [[("a", 0), ("a", 2), ("b", 1)], [("a", 1), ("b", 0)]]
    for num_trainers in (1, 2, 3, 7):
        dealt = [tp for t in range(num_trainers) for tp in partitions_for(t, num_trainers, partitions)]
        assert sorted(dealt) == sorted(partitions)
    assert partitions_for(6, 7, partitions) == []
    with pytest.raises(ValueError, match="trainer 2 is not one of 2"):
        partitions_for(2, 2, partitions)


def test_positions_are_plain_json_and_checked() -> None:
    position = kafka_position({("clicks", 1): 7, ("clicks", 0): 3})
    assert position == {"version": 1, "format": "kafka", "offsets": {"clicks": {"0": 3, "1": 7}}}
    assert position_offsets(json.loads(json.dumps(position))) == {("clicks", 0): 3, ("clicks", 1): 7}
    with pytest.raises(ValueError, match="not a Kafka reader's position"):
        position_offsets({"version": 1, "format": "parquet", "unit": 0})
    with pytest.raises(ValueError, match="csv/tsv"):
        KafkaSource(bootstrap_servers="127.0.0.1:1", topics=["t"], columns=["label"])


def test_tsv_stream_gives_the_file_readers_batches(
    kafka_broker: KafkaBroker, criteo_lines: list[str], tmp_path: Path
) -> None:
    """Each partition read alone gives exactly the batches of a file of its rows; both partitions
    read together give every row once, each partition's in order, and end at the partitions' ends."""
    topic = _topic("tsv")
    kafka_broker.create_topic(topic, partitions=2)
    where = _partition_of(len(criteo_lines))
    kafka_broker.produce(
        topic, [(int(p), line.encode()) for p, line in zip(where, criteo_lines, strict=True)]
    )
    schema = criteo_schema()
    source = _source(kafka_broker, topic)
    assert topic_partitions(source) == [(topic, 0), (topic, 1)]
    oracle = {}
    for partition in (0, 1):
        lines = [line for line, p in zip(criteo_lines, where, strict=True) if p == partition]
        oracle[partition] = _file_batches(tmp_path, f"p{partition}", lines, schema, batch_size=50)
        (mine,) = [partitions_for(t, 2, topic_partitions(source)) for t in range(2)][partition]
        stream = _read(source, schema, batch_size=50, partitions=[mine], until="end")
        assert len(stream) == len(oracle[partition]) > 2
        for got, expected in zip(stream, oracle[partition], strict=True):
            _assert_same_rows(got, expected)
        row_ids = np.concatenate([batch.row_ids for batch in stream])  # type: ignore[misc]
        np.testing.assert_array_equal(row_ids, row_id_slot(0, partition) + np.arange(len(lines)))

    with open_kafka_reader(source, schema, batch_size=64, until="end") as reader:
        both = list(reader)
        end = reader.position()
        stats = reader.stats()
    assert end["offsets"] == {topic: {"0": int((where == 0).sum()), "1": int((where == 1).sum())}}
    assert stats["rows_read"] == ROWS and stats["rows_skipped"] == 0
    assert all(batch.batch_size == 64 for batch in both[:-1])
    everything = concat_batches(both)
    for partition in (0, 1):
        rows = _partition(everything) == partition
        assert np.all(np.diff(everything.row_ids[rows] & OFFSET_MASK) == 1)  # type: ignore[index]
        expected = concat_batches(oracle[partition])
        np.testing.assert_array_equal(everything.labels[rows], expected.labels)
        np.testing.assert_array_equal(everything.dense[rows], expected.dense)
        for key in schema.feature_names[13:]:
            ids, _ = everything.sparse.feature(key)
            np.testing.assert_array_equal(ids[rows], expected.sparse.feature(key)[0])


def test_json_stream_gives_the_file_readers_batches(
    kafka_broker: KafkaBroker, criteo_lines: list[str], tmp_path: Path
) -> None:
    """JSON objects (numbers as numbers, missing values absent or null) make the batches of the same
    rows as a TSV file."""
    topic = _topic("json")
    kafka_broker.create_topic(topic, partitions=1)
    lines = criteo_lines[:300]
    kafka_broker.produce(topic, [(0, _json_row(line)) for line in lines])
    schema = criteo_schema()
    oracle = _file_batches(tmp_path, "json", lines, schema, batch_size=100)
    stream = _read(_source(kafka_broker, topic, "json"), schema, batch_size=100, until="end")
    assert len(stream) == len(oracle) == 3
    for got, expected in zip(stream, oracle, strict=True):
        _assert_same_rows(got, expected)


def test_json_lists_and_integer_ids_read_like_file_text(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    """Lists join as multi-valued text, integers hash as their decimal text, pass-through ids pass."""
    schema = Schema(
        label="click",
        dense=[DenseFeature(name="price", log1p=True)],
        sparse=[
            SparseFeature(name="user", table="users"),
            SparseFeature(name="tags", table="tags", multi_valued=True),
            SparseFeature(name="slot", table="slots", hashed=False),
        ],
    )
    rows = [
        {"click": 1, "price": 3.5, "user": 17, "tags": ["a", "b"], "slot": 4, "extra": "ignored"},
        {"click": 0, "price": None, "user": "u9", "tags": [], "slot": 0},
        {"click": 1, "user": 5, "tags": ["c", 7, "a"], "slot": 2**47},
    ]
    text = "click,price,user,tags,slot\n1,3.5,17,a|b,4\n0,,u9,,0\n1,,5,c|7|a,140737488355328\n"
    (tmp_path / "rows.csv").write_text(text)
    with open_reader(DataSource(format="csv", paths=[str(tmp_path / "rows.csv")]), schema, batch_size=8) as r:
        (expected,) = list(r)
    topic = _topic("lists")
    kafka_broker.create_topic(topic, partitions=1)
    kafka_broker.produce(topic, [(0, json.dumps(row).encode()) for row in rows])
    (got,) = _read(_source(kafka_broker, topic, "json"), schema, batch_size=8, until="end")
    _assert_same_rows(got, expected)
    assert got.sparse.feature("slot")[0].tolist() == [4, 0, 2**47]


def _read_with_stops(
    broker: KafkaBroker, source: KafkaSource, schema: Schema, stops: list[int], *, kill_at: int
) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Read in rounds of `stops[i]` batches, each from the previous round's position (as a checkpoint
    stores it); the broker is SIGKILLed and started again before round `kill_at`."""
    seen: list[np.ndarray] = []
    positions: list[dict[str, Any]] = []
    position = None
    for round_number, stop in enumerate([*stops, 10**9]):
        if round_number == kill_at:
            broker.kill()
            broker.start()
        with open_kafka_reader(source, schema, batch_size=40, position=position, until="end") as reader:
            for count, batch in enumerate(reader, start=1):
                seen.append(batch.row_ids)  # type: ignore[arg-type]
                if count == stop:
                    break
            position = json.loads(json.dumps(reader.position()))
            positions.append(position)
    return seen, positions


def test_a_position_resumes_with_exactly_the_rest_across_a_broker_kill(
    kafka_broker: KafkaBroker, criteo_lines: list[str]
) -> None:
    topic = _topic("resume")
    kafka_broker.create_topic(topic, partitions=2)
    where = _partition_of(len(criteo_lines))
    kafka_broker.produce(
        topic, [(int(p), line.encode()) for p, line in zip(where, criteo_lines, strict=True)]
    )
    source = _source(kafka_broker, topic)
    seen, positions = _read_with_stops(kafka_broker, source, criteo_schema(), [2, 1, 3, 4], kill_at=2)
    row_ids = np.concatenate(seen)
    assert row_ids.size == ROWS == np.unique(row_ids).size  # every row, none twice
    for partition in (0, 1):
        mine = row_ids[(row_ids >> OFFSET_BITS) == partition] & OFFSET_MASK
        np.testing.assert_array_equal(mine, np.arange(int((where == partition).sum())))  # in order
    assert positions[-1]["offsets"][topic] == {"0": int((where == 0).sum()), "1": int((where == 1).sum())}
    assert positions[0] != positions[1] != positions[2]


def test_a_reader_goes_on_when_the_broker_is_killed_under_it(
    kafka_broker: KafkaBroker, criteo_lines: list[str]
) -> None:
    """An open reader's client reconnects to the restarted broker and goes on from where it was: it
    reads the rows produced before the kill and those produced to the restarted broker, each once."""
    topic = _topic("live")
    kafka_broker.create_topic(topic, partitions=2)
    where = _partition_of(len(criteo_lines))
    messages = [(int(p), line.encode()) for p, line in zip(where, criteo_lines, strict=True)]
    half = len(messages) // 2
    kafka_broker.produce(topic, messages[:half])
    ends = {topic: {partition: int((where == partition).sum()) for partition in (0, 1)}}
    source = _source(kafka_broker, topic, client={**CLIENT, "reconnect.backoff.max.ms": 200})
    seen = []
    with open_kafka_reader(
        source, criteo_schema(), batch_size=40, until=ends, idle_timeout_s=20, prefetch=0
    ) as reader:
        for count, batch in enumerate(reader):
            seen.append(batch.row_ids)
            if count == 1:
                kafka_broker.kill()
                kafka_broker.start()
                kafka_broker.produce(topic, messages[half:])
    row_ids = np.concatenate(seen)  # type: ignore[arg-type]
    assert row_ids.size == ROWS == np.unique(row_ids).size


BAD_TSV = [
    (b"1\t2", "expected 40 columns, got 2"),
    (b"", "an empty message"),
    (b"1\t" + b"\t" * 38 + b"\n2", "a message of several lines"),
    (b"2" + b"\t" * 39, "label 'label' is 2: expected 0 or 1"),
    (b"x" + b"\t" * 39, "column label: cannot parse 'x'"),
]
BAD_JSON = [
    (b"{not json", "not a JSON object"),
    (b"[1, 2]", "a JSON object expected, got list"),
    (b'{"label": true}', "column label: expected a number or null, got True"),
    (b'{"label": 1, "I1": "7"}', "column I1: expected a number or null, got '7'"),
    (b'{"label": 1, "C1": 1.5}', "column C1: expected text, an integer or a list of them"),
    (b'{"I1": 1}', "missing label 'label'"),
]


@pytest.mark.parametrize("message_format", ["tsv", "json"])
def test_bad_messages_raise_naming_the_place_or_are_counted(
    kafka_broker: KafkaBroker, criteo_lines: list[str], message_format: str
) -> None:
    bad = BAD_TSV if message_format == "tsv" else BAD_JSON
    encode = (lambda line: line.encode()) if message_format == "tsv" else _json_row
    good = [encode(line) for line in criteo_lines[: len(bad)]]
    messages = [message for pair in zip(good, [b for b, _ in bad], strict=True) for message in pair]
    topic = _topic(f"bad-{message_format}")
    kafka_broker.create_topic(topic, partitions=1)
    kafka_broker.produce(topic, [(0, message) for message in messages])
    schema = criteo_schema()

    with pytest.raises(BadRowError) as caught:
        _read(_source(kafka_broker, topic, message_format), schema, batch_size=4, until="end")
    error = caught.value
    assert (error.path, error.location) == (f"topic {topic!r} partition 0", "offset 1")
    assert bad[0][1] in error.reason and "on_error: skip" in error.reason

    source = _source(kafka_broker, topic, message_format, on_error="skip")
    with open_kafka_reader(source, schema, batch_size=4, until="end") as reader:
        batches = list(reader)
        stats, end = reader.stats(), reader.position()
    row_ids = np.concatenate([batch.row_ids for batch in batches])  # type: ignore[misc]
    assert (row_ids & OFFSET_MASK).tolist() == list(range(0, len(messages), 2))  # the good ones
    assert stats["rows_skipped"] == len(bad)
    samples = stats["skipped_samples"]
    assert [sample["location"] for sample in samples] == [f"offset {2 * i + 1}" for i in range(len(bad))]
    for sample, (_, reason) in zip(samples, bad, strict=True):
        assert reason in sample["reason"] and sample["file"] == f"topic {topic!r} partition 0"
    assert end["offsets"] == {topic: {"0": len(messages)}}  # past the last (bad) message too


def test_until_offsets_and_the_idle_time_out_end_the_stream(
    kafka_broker: KafkaBroker, criteo_lines: list[str]
) -> None:
    topic = _topic("until")
    kafka_broker.create_topic(topic, partitions=2)
    kafka_broker.produce(topic, [(i % 2, line.encode()) for i, line in enumerate(criteo_lines[:100])])
    source, schema = _source(kafka_broker, topic), criteo_schema()
    start = kafka_position({(topic, 0): 5, (topic, 1): 0})
    with open_kafka_reader(
        source, schema, batch_size=7, position=start, until={topic: {0: 20, "1": 3}}, idle_timeout_s=10
    ) as reader:
        rows = np.concatenate([batch.row_ids for batch in reader])  # type: ignore[misc]
        assert reader.position()["offsets"][topic] == {"0": 20, "1": 3}
    assert sorted(rows.tolist()) == [*range(5, 20), *(row_id_slot(0, 1) + np.arange(3)).tolist()]
    began = time.monotonic()
    batches = _read(source, schema, batch_size=30, idle_timeout_s=0.5)
    assert sum(batch.batch_size for batch in batches) == 100
    assert time.monotonic() - began < 5


def test_a_continuous_reader_stops_when_closed(kafka_broker: KafkaBroker, criteo_lines: list[str]) -> None:
    """Without an end the source waits for messages (full batches only) until the reader is closed."""
    topic = _topic("continuous")
    kafka_broker.create_topic(topic, partitions=1)
    kafka_broker.produce(topic, [(0, line.encode()) for line in criteo_lines[:50]])
    reader = open_kafka_reader(_source(kafka_broker, topic), criteo_schema(), batch_size=20)
    batches = []
    for batch in reader:
        batches.append(batch)
        if len(batches) == 2:
            break
    began = time.monotonic()
    reader.close()
    assert time.monotonic() - began < 2
    assert reader.position()["offsets"] == {topic: {"0": 40}}


def test_broker_and_source_talk_on_loopback_only(kafka_broker: KafkaBroker, criteo_lines: list[str]) -> None:
    import importlib

    pids = [pid for pid in (kafka_broker.pid, kafka_broker.s3_pid) if pid is not None]
    listening = listening_sockets(pids)  # imports Ray, which puts its psutil on sys.path
    psutil = importlib.import_module("psutil")
    assert {pid for pid, *_ in listening} == set(pids)
    assert all(is_loopback(address) for _, _, address, _ in listening), listening
    topic = _topic("loopback")
    kafka_broker.create_topic(topic, partitions=1)
    kafka_broker.produce(topic, [(0, line.encode()) for line in criteo_lines[:20]])
    with open_kafka_reader(_source(kafka_broker, topic), criteo_schema(), batch_size=5, prefetch=0) as reader:
        batches = iter(reader)  # held: a dropped generator closes its consumer
        next(batches)
        remote = [c.raddr for c in psutil.Process().net_connections(kind="inet") if c.raddr]
    assert any(address.port == kafka_broker.port for address in remote), (remote, kafka_broker.port)
    assert all(is_loopback(address.ip) for address in remote), remote


def test_unknown_topics_are_refused(kafka_broker: KafkaBroker) -> None:
    source = _source(kafka_broker, _topic("absent"))
    with pytest.raises(ValueError, match="does not exist"):
        open_kafka_reader(source, criteo_schema(), batch_size=4)
    with pytest.raises(ValueError, match="not the source's topics"):
        open_kafka_reader(source, criteo_schema(), batch_size=4, partitions=[("other", 0)])
