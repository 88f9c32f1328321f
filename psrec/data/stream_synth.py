"""A synthetic click-through stream whose ids drift, produced into Kafka at a steady rate.

Continuous training exists because a real id space keeps moving: new items and users appear every
minute and old ones stop appearing. `DriftingCtrStream` generates such a stream, deterministically
from a seed, with a label that a model can learn per id; `produce_stream` sends it into a Kafka topic
at a steady rate, and `write_events` writes the same events to a file, the oracle of a test or a
benchmark that consumes the topic.

Events. Event `i` (0, 1, 2, ...) happens `i / events_per_second` seconds after the stream's start
(event time: its time in the stream, not when it is sent). Ids of one kind (users, items) are born
at a steady rate and each lives a fixed time::

    alive(t) = [floor(born_per_second * t), floor(born_per_second * t) + alive_count)
    alive_count = round(born_per_second * lifetime_s)

so at any time exactly `alive_count` ids of each kind can appear, a new one enters the window every
`1 / born_per_second` seconds and the oldest leaves it (a user or item id is its birth number; the
window is full from event 0 on). An event's user is uniform over the alive users; its item is drawn
from the alive items, the newest most often (the offset from the newest is `alive_count * u**2`).
The item's `category` is fixed per item; `context` (say, the device or the page) is uniform.

Columns: `label` (0/1); dense `position` (1..10, the slot shown in), `item_age_minutes` (since the
item's birth) and `price` (fixed per item); sparse integer ids `user`, `item`, `category`,
`context` (hashed by the schema like any id: `7` and `"7"` are the same id). `drifting_ctr_schema`
is their `Schema`.

Label. A hidden logistic model over per-id values (drawn from a hash of the seed, the kind and the
id, so each id keeps its value without a table) and the dense features::

    logit = bias + a_item[item] + a_user[user] + <f_user[user], f_item[item]> + a_category[category]
            + a_context[context] - 0.15 (position - 1) - 0.6 item_age / item_lifetime
            - 0.25 (log(price) - 2.5)
    label ~ Bernoulli(sigmoid(logit))

with a uniform in [-s, s], s = 1.2 (item), 0.6 (user), 0.4 (category), 0.3 (context), and f
4-dimensional, uniform in [-1, 1] per dimension, their product scaled by 0.9. The positive rate is ~17% and the Bayes-optimal AUC ~0.77. A model learns the ids' values only
while they are alive, so a model that stops learning loses AUC as the ids it knows leave the window:
what a continuously trained model with dynamic (collisionless) tables recovers.

Determinism. Every value of event `i` is a hash of (seed, i), never a sequential random draw:
`table(start, stop)` gives the same rows whatever the slices asked for, and the rows do not depend
on how fast they are produced.

Event time on the wire and in files. A Kafka message is one row of the schema's columns (a JSON
object or a TSV line in the schema's column order, as `psrec.data.message_format` decodes them);
its event time is the message's timestamp (CreateTime, in ms)::

    event_time_ms(i) = start_ms + floor(i * 1000 / events_per_second)

`produce_stream` takes `start_ms` (default: the wall clock when it starts, so brokers' time-based
retention treats the messages as new) and reports it; `write_events(..., start_ms=that)` writes the
same events with an `event_time_ms` column (Parquet, or TSV with a header; readers of the schema
ignore the extra column). With `events_per_second` equal to the producer's rate (as `psrec data
produce` sets it), event time keeps pace with the wall clock::

    stream = DriftingCtrStream(0, events_per_second=2000)
    summary = produce_stream("127.0.0.1:9092", "clicks", stream, events=120_000, rate_per_second=2000,
                             partitions=2)
    write_events("oracle.parquet", stream, events=120_000, start_ms=summary.start_ms)

Messages are keyed by user id (`key="user"`, the default; or "item", or "none": round robin), and
the partition is computed here (`event_partitions`), so each user's events stay in order in one
partition and an oracle knows which. Run: `psrec data produce --bootstrap-servers HOST:PORT
--topic clicks --rate 2000 --seconds 60 --partitions 2`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from psrec.data.schema import DenseFeature, MessageFormat, Schema, SparseFeature
from psrec.data.synth import splitmix64

logger = logging.getLogger(__name__)

LABEL = "label"
DENSE = ("position", "item_age_minutes", "price")
SPARSE = ("user", "item", "category", "context")
EVENT_TIME = "event_time_ms"
COLUMNS = (LABEL, *DENSE, *SPARSE)  # a message's columns, in the schema's order (TSV lines)

PartitionKey = Literal["user", "item", "none"]
FileFormat = Literal["parquet", "tsv"]

POSITIONS = 10
FACTOR_DIM = 4
BIAS = -1.0
ITEM_SCALE = 1.2
USER_SCALE = 0.6
FACTOR_SCALE = 0.9
CATEGORY_SCALE = 0.4
CONTEXT_SCALE = 0.3
POSITION_WEIGHT = -0.15
AGE_WEIGHT = -0.6
PRICE_WEIGHT = -0.25
PRICE_LOG_CENTER = 2.5
# Salts of the hashes: one per random quantity, so that none is correlated with another.
_USER, _ITEM, _CONTEXT, _POSITION, _LABEL = 1, 2, 3, 4, 5
_ITEM_WEIGHT, _USER_WEIGHT, _CATEGORY_WEIGHT, _CONTEXT_WEIGHT, _CATEGORY, _PRICE = 10, 11, 12, 13, 14, 15
_ITEM_FACTOR, _USER_FACTOR = 20, 30  # + factor dimension
_PARTITION = 40

CHUNK_EVENTS = 4096  # events generated at a time while producing
SEND_TICK_S = 0.005  # the producer sends what is due every 5 ms at most (steady, not spinning)
METADATA_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 30.0
_MASK64 = (1 << 64) - 1


def drifting_ctr_schema() -> Schema:
    """The `Schema` of `DriftingCtrStream`'s rows: label, 3 dense features, 4 hashed id features, each
    id feature in a table of its own name."""
    return Schema(
        label=LABEL,
        dense=[
            DenseFeature(name="position"),
            DenseFeature(name="item_age_minutes", log1p=True),
            DenseFeature(name="price", log1p=True),
        ],
        sparse=[SparseFeature(name=name, table=name) for name in SPARSE],
    )


def _key(seed: int, salt: int) -> np.uint64:
    """A 64-bit key per (seed, salt), mixed so that nearby seeds and salts give unrelated keys."""
    mixed = splitmix64(np.array([(seed * 0x100000001B3 + salt) & _MASK64], dtype=np.uint64))
    return np.uint64(splitmix64(mixed)[0])


def _uniform(seed: int, salt: int, values: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) per (seed, salt, value) for non-negative int64 `values`, a pure function."""
    bits = splitmix64(values.astype(np.uint64) ^ _key(seed, salt)) >> np.uint64(11)
    return bits.astype(np.float64) / float(1 << 53)


def _signed(seed: int, salt: int, values: np.ndarray) -> np.ndarray:
    """Uniform [-1, 1) per (seed, salt, value)."""
    return _uniform(seed, salt, values) * 2.0 - 1.0


@dataclass(frozen=True)
class IdWindow:
    """Ids of one kind born `born_per_second` (event time) and each alive `lifetime_s` seconds."""

    born_per_second: float
    lifetime_s: float

    def __post_init__(self) -> None:
        if not self.born_per_second > 0 or not self.lifetime_s > 0:
            raise ValueError(f"need born_per_second > 0 and lifetime_s > 0, got {self}")
        if self.alive_count < 1:
            raise ValueError(
                f"{self}: fewer than one id alive at a time (born_per_second * lifetime_s < 0.5)"
            )

    @property
    def alive_count(self) -> int:
        """How many ids are alive at any time."""
        return round(self.born_per_second * self.lifetime_s)

    def first_alive(self, seconds: np.ndarray) -> np.ndarray:
        """The oldest alive id at each event time (seconds since the stream's start)."""
        return np.floor(seconds * self.born_per_second).astype(np.int64)

    def birth_seconds(self, ids: np.ndarray) -> np.ndarray:
        """When each id enters the window (negative for the ids alive at the start)."""
        return (ids - self.alive_count + 1) / self.born_per_second


class DriftingCtrStream:
    """Click-through events with drifting user and item ids (see the module docstring).

    seed: the stream (rows and hidden model). events_per_second: events per second of event time.
    items_per_second, item_lifetime_s / users_per_second, user_lifetime_s: how fast ids of each kind
    are born and how long each is alive. categories, contexts: sizes of those vocabularies.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        events_per_second: int = 1000,
        items_per_second: float = 2.0,
        item_lifetime_s: float = 300.0,
        users_per_second: float = 5.0,
        user_lifetime_s: float = 600.0,
        categories: int = 50,
        contexts: int = 8,
    ) -> None:
        if events_per_second < 1:
            raise ValueError(f"events_per_second must be >= 1, got {events_per_second}")
        if categories < 1 or contexts < 1:
            raise ValueError(f"categories and contexts must be >= 1, got {categories}, {contexts}")
        self.seed = seed
        self.events_per_second = events_per_second
        self.items = IdWindow(items_per_second, item_lifetime_s)
        self.users = IdWindow(users_per_second, user_lifetime_s)
        self.categories = categories
        self.contexts = contexts

    def event_offsets_ms(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) int64: event time of events [start, stop) in ms after the stream's start."""
        return (np.arange(start, stop, dtype=np.int64) * 1000) // self.events_per_second

    def _events(self, start: int, stop: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(columns, hidden logits) of events [start, stop)."""
        if not 0 <= start <= stop:
            raise ValueError(f"need 0 <= start <= stop, got [{start}, {stop})")
        index = np.arange(start, stop, dtype=np.int64)
        seconds = index / self.events_per_second
        seed = self.seed
        users = self.users.first_alive(seconds) + np.floor(
            _uniform(seed, _USER, index) * self.users.alive_count
        ).astype(np.int64)
        newest = self.items.first_alive(seconds) + self.items.alive_count - 1
        offsets = np.floor(_uniform(seed, _ITEM, index) ** 2 * self.items.alive_count).astype(np.int64)
        items = newest - offsets
        categories = np.floor(_uniform(seed, _CATEGORY, items) * self.categories).astype(np.int64)
        contexts = np.floor(_uniform(seed, _CONTEXT, index) * self.contexts).astype(np.int64)
        positions = 1.0 + np.floor(_uniform(seed, _POSITION, index) * POSITIONS)
        age_seconds = seconds - self.items.birth_seconds(items)
        ages = np.round(age_seconds / 60.0, 2)
        prices = np.round(np.exp(1.0 + 3.0 * _uniform(seed, _PRICE, items)), 2)
        logit = (
            BIAS
            + ITEM_SCALE * _signed(seed, _ITEM_WEIGHT, items)
            + USER_SCALE * _signed(seed, _USER_WEIGHT, users)
            + CATEGORY_SCALE * _signed(seed, _CATEGORY_WEIGHT, categories)
            + CONTEXT_SCALE * _signed(seed, _CONTEXT_WEIGHT, contexts)
            + POSITION_WEIGHT * (positions - 1.0)
            + AGE_WEIGHT * age_seconds / self.items.lifetime_s
            + PRICE_WEIGHT * (np.log(prices) - PRICE_LOG_CENTER)
        )
        for dimension in range(FACTOR_DIM):
            logit += FACTOR_SCALE * (
                _signed(seed, _USER_FACTOR + dimension, users)
                * _signed(seed, _ITEM_FACTOR + dimension, items)
            )
        labels = (_uniform(seed, _LABEL, index) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        columns = {
            LABEL: labels,
            "position": positions,
            "item_age_minutes": ages,
            "price": prices,
            "user": users,
            "item": items,
            "category": categories,
            "context": contexts,
        }
        return columns, logit

    def table(self, start: int, stop: int, *, start_ms: int = 0) -> pa.Table:
        """Events [start, stop) as an Arrow table: the `COLUMNS` (label and ids int64, dense float64)
        and `event_time_ms` (int64, `start_ms` plus the event's offset)."""
        columns, _ = self._events(start, stop)
        arrays: dict[str, pa.Array] = {name: pa.array(values) for name, values in columns.items()}
        arrays[EVENT_TIME] = pa.array(start_ms + self.event_offsets_ms(start, stop))
        return pa.table(arrays)

    def click_probabilities(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) float64: the hidden model's click probability of each event (the Bayes
        oracle: no model can predict the labels better)."""
        _, logit = self._events(start, stop)
        return 1.0 / (1.0 + np.exp(-logit))


def event_partitions(
    table: pa.Table, partitions: int, key: PartitionKey = "user", *, first: int = 0
) -> np.ndarray:
    """(rows,) int64: the partition each event of `table` (from `DriftingCtrStream.table`) is sent to:
    a hash of its user (or item) id, or, for key "none", the event's index modulo `partitions`
    (`first`: the index of the table's first event)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if key == "none":
        return np.arange(first, first + table.num_rows, dtype=np.int64) % partitions
    if key not in ("user", "item"):
        raise ValueError(f"key must be 'user', 'item' or 'none', not {key!r}")
    ids = table.column(key).to_numpy()
    return (splitmix64(ids.astype(np.uint64) ^ _key(0, _PARTITION)) % np.uint64(partitions)).astype(np.int64)


def _text(value: Any) -> str:
    return str(value)  # ints as digits; floats as Python's shortest repr, which parses back exactly


def encode_messages(table: pa.Table, message_format: MessageFormat) -> list[bytes]:
    """Each row of `table` as a message of `COLUMNS`: a JSON object (`"json"`), or a line in `COLUMNS`
    order, tab separated (`"tsv"`) or comma separated (`"csv"`); no event time (it is the timestamp)."""
    rows = table.select(list(COLUMNS)).to_pylist()
    if message_format == "json":
        return [json.dumps(row, separators=(",", ":")).encode() for row in rows]
    if message_format not in ("tsv", "csv"):
        raise ValueError(f"message_format must be json, tsv or csv, not {message_format!r}")
    delimiter = "\t" if message_format == "tsv" else ","
    return [delimiter.join(_text(row[name]) for name in COLUMNS).encode() for row in rows]


def write_events(
    path: str | Path,
    stream: DriftingCtrStream,
    *,
    events: int,
    start_ms: int = 0,
    format: FileFormat = "parquet",
    chunk_events: int = 65536,
) -> Path:
    """Write events [0, events) of `stream` to one file: Parquet, or TSV with a header line; both with
    the `COLUMNS` and `event_time_ms`. Read them back with the schema as
    `DataSource(format="parquet", ...)` or `DataSource(format="csv", delimiter="\\t", ...)`: the
    rows are those that `produce_stream`'s messages decode to."""
    if events < 0 or chunk_events < 1:
        raise ValueError(f"need events >= 0 and chunk_events >= 1, got {events}, {chunk_events}")
    if format not in ("parquet", "tsv"):
        raise ValueError(f"format must be 'parquet' or 'tsv', not {format!r}")
    target = Path(path)
    chunks = (
        stream.table(first, min(events, first + chunk_events), start_ms=start_ms)
        for first in range(0, max(events, 1), chunk_events)
    )
    if format == "parquet":
        writer: pq.ParquetWriter | None = None
        try:
            for table in chunks:
                if writer is None:
                    writer = pq.ParquetWriter(target, table.schema, compression="zstd")
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
    else:
        names = [*COLUMNS, EVENT_TIME]
        with target.open("w", encoding="utf-8") as file:
            file.write("\t".join(names) + "\n")
            for table in chunks:
                for row in table.to_pylist():
                    file.write("\t".join(_text(row[name]) for name in names) + "\n")
    logger.info("wrote %d events of stream seed %d to %s", events, stream.seed, target)
    return target


def ensure_topic(
    bootstrap_servers: str,
    topic: str,
    partitions: int | None = None,
    *,
    client: dict[str, Any] | None = None,
    timeout: float = METADATA_TIMEOUT_S,
) -> int:
    """The partition count of `topic`, creating it (with `partitions`, default 1, replication 1) if it
    does not exist; raises if it exists with another count than `partitions`. The broker's metadata
    is asked for all topics, never for this one by name: some brokers create a topic asked for."""
    if partitions is not None and partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    settings: dict[str, Any] = {"logger": logger, **(client or {}), "bootstrap.servers": bootstrap_servers}
    admin = AdminClient(settings)
    found = admin.list_topics(timeout=timeout).topics.get(topic)
    if found is not None and found.error is None:
        count = len(found.partitions)
        if partitions is not None and count != partitions:
            raise ValueError(
                f"topic {topic!r} exists with {count} partitions, not the {partitions} asked for"
            )
        return count
    wanted = partitions or 1
    futures = admin.create_topics([NewTopic(topic, wanted, 1)], operation_timeout=timeout)
    futures[topic].result(timeout)
    deadline = time.monotonic() + timeout
    while True:
        found = admin.list_topics(timeout=timeout).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) >= wanted:
            logger.info("created topic %s with %d partitions on %s", topic, wanted, bootstrap_servers)
            return wanted
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {topic!r} has not got its {wanted} partitions in {timeout} s")
        time.sleep(0.05)


@dataclass(frozen=True)
class ProduceSummary:
    """What `produce_stream` sent: `events` messages to `topic`, `per_partition[p]` of them to
    partition p, with event times `start_ms` .. `end_ms` (the last event's), in `seconds` of wall
    time, `message_bytes` of message values in all."""

    topic: str
    events: int
    per_partition: tuple[int, ...]
    start_ms: int
    end_ms: int
    seconds: float
    message_bytes: int

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else math.inf


def _chunks(
    stream: DriftingCtrStream, events: int, start_ms: int, partitions: int, key: PartitionKey
) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """(table, partitions) of events [0, events), `CHUNK_EVENTS` at a time."""
    for first in range(0, events, CHUNK_EVENTS):
        table = stream.table(first, min(events, first + CHUNK_EVENTS), start_ms=start_ms)
        yield table, event_partitions(table, partitions, key, first=first)


def produce_stream(
    bootstrap_servers: str,
    topic: str,
    stream: DriftingCtrStream,
    *,
    events: int,
    rate_per_second: float,
    partitions: int | None = None,
    key: PartitionKey = "user",
    message_format: MessageFormat = "json",
    start_ms: int | None = None,
    client: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> ProduceSummary:
    """Produce events [0, events) of `stream` into `topic` at `rate_per_second`; see the module
    docstring. With `stop`, producing ends early once it is set (the summary counts what was sent).

    Event i is sent when `i / rate_per_second` seconds have passed since the start (scheduled, not in
    bursts; a producer that falls behind sends what is due at once), timestamped with its event time
    (from `start_ms`, default: now), keyed and partitioned by `key` (`event_partitions`). The topic is
    created with `partitions` (default 1) if missing (`ensure_topic`). `client`: more librdkafka
    settings. `progress(events_sent)` is called after each batch sent. Returns once every message is
    acknowledged (acks=all, idempotent); raises if one fails.
    """
    if events < 0:
        raise ValueError(f"events must be >= 0, got {events}")
    if not rate_per_second > 0:
        raise ValueError(f"rate_per_second must be > 0, got {rate_per_second}")
    if key not in ("user", "item", "none"):
        raise ValueError(f"key must be 'user', 'item' or 'none', not {key!r}")
    count = ensure_topic(bootstrap_servers, topic, partitions, client=client)
    first_ms = int(time.time() * 1000) if start_ms is None else start_ms
    settings: dict[str, Any] = {
        "logger": logger,
        "linger.ms": 5,
        **(client or {}),
        "bootstrap.servers": bootstrap_servers,
        "acks": "all",
        "enable.idempotence": True,
    }
    producer = Producer(settings)
    failures: list[str] = []

    def delivered(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(f"partition {message.partition()}: {error}")

    per_partition = [0] * count
    message_bytes = 0
    sent = 0
    began = time.monotonic()
    for table, where in _chunks(stream, events, first_ms, count, key):
        values = encode_messages(table, message_format)
        keys = table.column(key).to_pylist() if key != "none" else None
        times = table.column(EVENT_TIME).to_pylist()
        done = 0
        while done < len(values):
            due = min(events, math.floor((time.monotonic() - began) * rate_per_second) + 1)
            if due <= sent:  # wait for the next event's send time, serving deliveries meanwhile
                # at least a tick: shorter waits return at once and spin a core
                producer.poll(max(SEND_TICK_S, began + sent / rate_per_second - time.monotonic()))
                continue
            for index in range(done, min(len(values), done + due - sent)):
                partition = int(where[index])
                message_key = str(keys[index]).encode() if keys is not None else None
                while True:
                    try:
                        producer.produce(
                            topic,
                            value=values[index],
                            key=message_key,
                            partition=partition,
                            timestamp=times[index],
                            on_delivery=delivered,
                        )
                        break
                    except BufferError:  # the local queue is full: let deliveries drain it
                        producer.poll(0.05)
                per_partition[partition] += 1
                message_bytes += len(values[index])
                sent += 1
                done += 1
            producer.poll(0)
            if failures or (stop is not None and stop.is_set()):
                break
            if progress is not None:
                progress(sent)
        if failures or (stop is not None and stop.is_set()):
            break
    left = producer.flush(FLUSH_TIMEOUT_S)
    seconds = time.monotonic() - began
    if failures or left:
        raise RuntimeError(
            f"{len(failures) + left} of {sent} message(s) not delivered to {topic}: {failures[:5]}"
            + (f"; {left} unacknowledged after {FLUSH_TIMEOUT_S} s" if left else "")
        )
    last_ms = first_ms + int(stream.event_offsets_ms(max(sent - 1, 0), max(sent, 1))[0])
    logger.info("produced %d events to %s in %.2f s", sent, topic, seconds)
    return ProduceSummary(
        topic=topic,
        events=sent,
        per_partition=tuple(per_partition),
        start_ms=first_ms,
        end_ms=last_ms,
        seconds=seconds,
        message_bytes=message_bytes,
    )
