"""The drifting synthetic click stream (`psrec.data.stream_synth`) and its producer.

Generator: the same seed gives the same rows whatever slices are asked for; ids drift (the items of
the first and last minute are disjoint, no more than the window's ids ever appear together, each id
appears only in its lifetime); the label is learnable (a NumPy logistic regression on one-hot ids
beats chance on the next slice, and loses much of it where the ids it learnt are gone).

Producer, against the real broker (`kafka_broker` fixture, Tansu on 127.0.0.1): the messages read
back through `open_kafka_reader` give the rows `write_events`' file gives through `open_reader`
(JSON with a Parquet oracle, TSV with a TSV oracle), timestamps are the event times, each user's
events sit in one partition, the send rate follows the schedule, and the rate changes no message.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Consumer, TopicPartition

from psrec.cli import main
from psrec.data.batch import Batch, concat_batches
from psrec.data.kafka_source import KafkaSource, open_kafka_reader
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, MessageFormat
from psrec.data.stream_synth import (
    COLUMNS,
    EVENT_TIME,
    DriftingCtrStream,
    drifting_ctr_schema,
    encode_messages,
    ensure_topic,
    event_partitions,
    produce_stream,
    write_events,
)
from psrec.testing.kafka_broker import KafkaBroker

CLIENT = {"fetch.wait.max.ms": 20}
START_MS = 1_750_000_000_000
READ_TIMEOUT_S = 15.0


def _small(seed: int) -> DriftingCtrStream:
    """A small world: 120 items and 300 users alive at a time, 500 events a second of event time."""
    return DriftingCtrStream(
        seed,
        events_per_second=500,
        items_per_second=1.0,
        item_lifetime_s=120.0,
        users_per_second=1.0,
        user_lifetime_s=300.0,
    )


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney; ties of scores are rare here)."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores, kind="stable")] = np.arange(1, len(scores) + 1)
    positives = int(labels.sum())
    negatives = len(labels) - positives
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


# -- the generator ----------------------------------------------------------------------------------


def test_same_seed_same_rows_whatever_the_slices() -> None:
    stream = _small(7)
    whole = stream.table(0, 5000)
    cuts = [0, 1, 999, 1000, 3333, 5000]
    pieces = pa.concat_tables([stream.table(a, b) for a, b in zip(cuts, cuts[1:], strict=False)])
    assert pieces.equals(whole)
    assert _small(7).table(0, 5000).equals(whole)
    assert not _small(8).table(0, 5000).equals(whole)
    assert whole.column_names == [*COLUMNS, EVENT_TIME]
    shifted = stream.table(0, 5000, start_ms=START_MS)
    assert shifted.drop_columns([EVENT_TIME]).equals(whole.drop_columns([EVENT_TIME]))
    times = shifted.column(EVENT_TIME).to_numpy()
    np.testing.assert_array_equal(times, START_MS + np.arange(5000) * 1000 // 500)
    labels = whole.column("label").to_numpy()
    assert set(np.unique(labels)) == {0, 1} and 0.08 < labels.mean() < 0.3
    positions = whole.column("position").to_numpy()
    assert positions.min() == 1 and positions.max() == 10


def test_item_and_user_ids_drift_within_a_bounded_window() -> None:
    stream = _small(1)
    minute = 60 * 500
    table = stream.table(0, 5 * minute)
    items = table.column("item").to_numpy()
    users = table.column("user").to_numpy()
    first, last = set(items[:minute]), set(items[-minute:])
    assert len(first & last) == 0 and len(last) > 100  # 5 minutes on, every item is a new one
    # Users live 300 s: a third of those of the last minute were alive in the first one.
    assert len(set(users[:minute]) & set(users[-minute:])) < 0.4 * len(set(users[-minute:]))
    seconds = np.arange(len(items)) / 500
    for ids, window in ((items, stream.items), (users, stream.users)):
        # Alive at its event's time: in [first alive, first alive + alive count).
        oldest = window.first_alive(seconds)
        assert np.all(ids >= oldest) and np.all(ids < oldest + window.alive_count)
        # Any 10 s of events show at most the alive ids plus those born meanwhile.
        for start in range(0, len(ids), 10 * 500):
            distinct = len(np.unique(ids[start : start + 10 * 500]))
            assert distinct <= window.alive_count + 10 * window.born_per_second + 1
    # New items appear all the time: every 10 s brings items never seen before.
    seen: set[int] = set()
    for start in range(0, len(items), 10 * 500):
        chunk = set(items[start : start + 10 * 500].tolist())
        if seen:
            assert len(chunk - seen) >= 5
        seen |= chunk
    # Each item keeps its category and price.
    categories = table.column("category").to_numpy()
    prices = table.column("price").to_numpy()
    order = np.argsort(items, kind="stable")
    same_item = items[order][1:] == items[order][:-1]
    assert np.all(categories[order][1:][same_item] == categories[order][:-1][same_item])
    assert np.all(prices[order][1:][same_item] == prices[order][:-1][same_item])


_FEATURES = ("user", "item", "category", "context", "position")


def _one_hot_codes(table: pa.Table, vocabulary: dict[str, np.ndarray]) -> np.ndarray:
    """(rows, features) indices into one weight vector; an id not in `vocabulary` -> the last index
    (a weight that stays 0)."""
    codes = []
    offset = 0
    unknown = sum(len(values) for values in vocabulary.values())
    for name in _FEATURES:
        values = table.column(name).to_numpy()
        known = vocabulary[name]
        found = np.clip(np.searchsorted(known, values), 0, len(known) - 1)
        codes.append(np.where(known[found] == values, offset + found, unknown))
        offset += len(known)
    return np.stack(codes, axis=1)


def _logistic_regression(codes: np.ndarray, labels: np.ndarray, size: int) -> tuple[np.ndarray, float]:
    """Full-batch gradient descent on one-hot features, each weight's step scaled by its count."""
    weights = np.zeros(size + 1)
    bias = float(np.log(labels.mean() / (1 - labels.mean())))
    counts = np.maximum(np.bincount(codes.ravel(), minlength=size + 1), 1)
    for _ in range(300):
        error = 1.0 / (1.0 + np.exp(-(bias + weights[codes].sum(axis=1)))) - labels
        gradient = np.bincount(codes.ravel(), weights=np.repeat(error, codes.shape[1]), minlength=size + 1)
        weights -= 0.25 * gradient / counts + 0.5e-4 * weights
        bias -= 0.5 * float(error.mean())
    return weights, bias


def test_labels_are_learnable_per_id_and_go_stale_as_ids_drift() -> None:
    stream = _small(3)
    train = stream.table(0, 30_000)  # the first minute
    vocabulary = {name: np.unique(train.column(name).to_numpy()) for name in _FEATURES}
    size = sum(len(values) for values in vocabulary.values())
    labels = train.column("label").to_numpy().astype(np.float64)
    weights, bias = _logistic_regression(_one_hot_codes(train, vocabulary), labels, size)

    def auc_on(start: int, stop: int) -> float:
        test = stream.table(start, stop)
        scores = bias + weights[_one_hot_codes(test, vocabulary)].sum(axis=1)
        return _auc(test.column("label").to_numpy(), scores)

    next_slice = auc_on(30_000, 35_000)
    much_later = auc_on(200_000, 205_000)  # 6 minutes on: none of the items learnt is alive
    bayes = _auc(
        stream.table(30_000, 35_000).column("label").to_numpy(), stream.click_probabilities(30_000, 35_000)
    )
    assert next_slice > 0.65, next_slice
    assert much_later < next_slice - 0.05, (next_slice, much_later)
    assert next_slice < bayes < 0.85, bayes


def test_partitions_keep_each_user_in_one_and_messages_decode_to_the_columns() -> None:
    table = _small(2).table(0, 2000)
    where = event_partitions(table, 3)
    assert set(np.unique(where)) == {0, 1, 2}
    users = table.column("user").to_numpy()
    for user in np.unique(users):
        assert len(np.unique(where[users == user])) == 1
    np.testing.assert_array_equal(event_partitions(table, 3, "none", first=4), (np.arange(2000) + 4) % 3)
    json_line, tsv_line = (
        encode_messages(table.slice(0, 1), "json")[0],
        encode_messages(table.slice(0, 1), "tsv")[0],
    )
    row = table.slice(0, 1).to_pylist()[0]
    assert EVENT_TIME.encode() not in json_line
    assert tsv_line.decode().split("\t") == [str(row[name]) for name in COLUMNS]
    with pytest.raises(ValueError, match="key must be"):
        event_partitions(table, 2, "session")  # type: ignore[arg-type]


# -- into Kafka ----------------------------------------------------------------------------------


def _consume(broker: KafkaBroker, topic: str, partitions: int, count: int) -> list[Any]:
    """Every message of the topic's partitions (`count` in all), read from offset 0."""
    consumer = Consumer(broker.client_config(**{"group.id": "test", "enable.auto.commit": False, **CLIENT}))
    consumer.assign([TopicPartition(topic, partition, 0) for partition in range(partitions)])
    messages: list[Any] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    try:
        while len(messages) < count and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.2):
                assert message.error() is None, message.error()
                messages.append(message)
    finally:
        consumer.close()
    assert len(messages) == count
    return messages


def _stream_rows(broker: KafkaBroker, topic: str, partition: int, message_format: MessageFormat) -> Batch:
    source = KafkaSource(
        bootstrap_servers=broker.bootstrap_servers,
        topics=[topic],
        message_format=message_format,
        client=CLIENT,
        poll_timeout_s=0.1,
    )
    schema = drifting_ctr_schema()
    with open_kafka_reader(
        source, schema, batch_size=256, partitions=[(topic, partition)], until="end"
    ) as reader:
        return concat_batches(list(reader))


def _file_rows(source: DataSource) -> Batch:
    with open_reader(source, drifting_ctr_schema(), batch_size=1 << 20, prefetch=0) as reader:
        (batch,) = list(reader)
    return batch


def _assert_rows(stream: Batch, file: Batch, rows: np.ndarray) -> None:
    """The stream's rows are the file's `rows` (a mask), in order: labels, dense, every id."""
    np.testing.assert_array_equal(stream.labels, file.labels[rows])
    np.testing.assert_array_equal(stream.dense, file.dense[rows])
    assert stream.sparse.keys == file.sparse.keys
    for key in file.sparse.keys:
        np.testing.assert_array_equal(stream.sparse.feature(key)[0], file.sparse.feature(key)[0][rows])


def test_produced_json_stream_reads_as_the_parquet_oracle_at_the_scheduled_rate(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    stream = _small(11)
    topic = _topic("clicks")
    rate, events = 500, 1000
    sent_at: list[tuple[float, int]] = []
    began = time.monotonic()
    summary = produce_stream(
        kafka_broker.bootstrap_servers,
        topic,
        stream,
        events=events,
        rate_per_second=rate,
        partitions=2,
        progress=lambda done: sent_at.append((time.monotonic() - began, done)),
    )
    elapsed = time.monotonic() - began
    # The last event is due (events - 1) / rate = 2.0 s after the first; never ahead of the schedule.
    assert elapsed >= summary.seconds >= (events - 1) / rate
    assert summary.seconds < 2.0 + 3.0
    assert all(done <= seconds * rate + 1 for seconds, done in sent_at)
    assert summary.events == events == sum(summary.per_partition)
    assert summary.end_ms - summary.start_ms == (events - 1) * 1000 // 500

    oracle_path = write_events(tmp_path / "clicks.parquet", stream, events=events, start_ms=summary.start_ms)
    oracle = stream.table(0, events, start_ms=summary.start_ms)
    where = event_partitions(oracle, 2)
    assert summary.per_partition == tuple(int((where == p).sum()) for p in range(2))

    messages = _consume(kafka_broker, topic, 2, events)
    times = oracle.column(EVENT_TIME).to_numpy()
    users = oracle.column("user").to_numpy()
    for partition in range(2):
        mine = sorted((m for m in messages if m.partition() == partition), key=lambda m: m.offset())
        rows = np.flatnonzero(where == partition)
        assert [m.timestamp()[1] for m in mine] == times[rows].tolist()  # CreateTime = event time
        assert [m.key() for m in mine] == [str(user).encode() for user in users[rows]]

    file = _file_rows(DataSource(format="parquet", paths=[str(oracle_path)]))
    assert file.batch_size == events
    for partition in range(2):
        _assert_rows(_stream_rows(kafka_broker, topic, partition, "json"), file, where == partition)


def test_produced_tsv_stream_reads_as_the_tsv_oracle(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    stream = _small(12)
    topic = _topic("clicks-tsv")
    events = 600
    summary = produce_stream(
        kafka_broker.bootstrap_servers,
        topic,
        stream,
        events=events,
        rate_per_second=20_000,
        partitions=1,
        key="none",
        message_format="tsv",
        start_ms=START_MS,
    )
    assert summary.start_ms == START_MS and summary.per_partition == (events,)
    oracle_path = write_events(
        tmp_path / "clicks.tsv", stream, events=events, start_ms=START_MS, format="tsv"
    )
    assert oracle_path.read_text().splitlines()[0].split("\t") == [*COLUMNS, EVENT_TIME]
    file = _file_rows(DataSource(format="csv", delimiter="\t", paths=[str(oracle_path)]))
    _assert_rows(_stream_rows(kafka_broker, topic, 0, "tsv"), file, np.ones(events, dtype=bool))


def test_the_rate_changes_no_message(kafka_broker: KafkaBroker) -> None:
    stream = _small(13)
    received = []
    for rate in (1000.0, 50_000.0):
        topic = _topic("rate")
        produce_stream(
            kafka_broker.bootstrap_servers, topic, stream, events=300, rate_per_second=rate,
            partitions=2, start_ms=START_MS,
        )  # fmt: skip
        messages = _consume(kafka_broker, topic, 2, 300)
        received.append(
            sorted((m.partition(), m.offset(), m.key(), m.value(), m.timestamp()) for m in messages)
        )
    assert received[0] == received[1]


def test_ensure_topic_creates_once_and_checks_the_partition_count(kafka_broker: KafkaBroker) -> None:
    topic = _topic("ensure")
    assert ensure_topic(kafka_broker.bootstrap_servers, topic, 3) == 3
    assert ensure_topic(kafka_broker.bootstrap_servers, topic) == 3
    assert ensure_topic(kafka_broker.bootstrap_servers, topic, 3) == 3
    with pytest.raises(ValueError, match="exists with 3 partitions, not the 2"):
        ensure_topic(kafka_broker.bootstrap_servers, topic, 2)


def test_cli_produce(kafka_broker: KafkaBroker, capsys: pytest.CaptureFixture[str]) -> None:
    topic = _topic("cli")
    arguments = ["data", "produce", "--bootstrap-servers", kafka_broker.bootstrap_servers, "--topic", topic]
    code = main([*arguments, "--rate", "2000", "--events", "400", "--partitions", "2", "--format", "tsv"])
    assert code == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("produced 400 events (") and f"to {topic} [2 partition(s): " in summary
    messages = _consume(kafka_broker, topic, 2, 400)
    assert all(len(m.value().split(b"\t")) == len(COLUMNS) for m in messages)
    assert main([*arguments, "--rate", "100", "--seconds", "1", "--partitions", "3"]) == 1
    assert "exists with 2 partitions, not the 3" in capsys.readouterr().err
