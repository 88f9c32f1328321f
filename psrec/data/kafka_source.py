"""Kafka topics as a stream source: the partitions a trainer is dealt, read as `Batch`es with an exact
position, with the standard client (confluent-kafka, i.e. librdkafka).

psrec owns the consumer position. The source reads the partitions it is given (`assign`, never a
consumer group's rebalancing; `partitions_for` deals a topic's partitions to trainers), from explicit
offsets: its position is plain JSON, topic -> partition -> next offset to read::

    {"version": 1, "format": "kafka", "offsets": {"clicks": {"0": 1200, "1": 1187}}}

A checkpoint stores it with the model; `open_kafka_reader(..., position=it)` resumes exactly after
the last row delivered: no row skipped, none twice. Nothing is committed to the broker
(`enable.auto.commit` is off) and a partition absent from the position starts at its first offset.
An offset that the broker no longer holds (retention) raises instead of jumping ahead.

Each message is one row, decoded by `psrec.data.message_format` (a JSON object with the schema's
column names, a CSV/TSV line in a given column order, or an Avro record of `avro_schema`, bare or
in the Confluent wire format) into the same raw table a file of those rows gives, then hashed and
transformed by `features.prepare_table` as the file readers do: a stream row and a file row become
the same batch. Bad messages follow the source's `on_error` like bad file
rows (`BadRowError` naming topic, partition and offset, or counted in `stats()` and skipped; a
position is past the bad messages before its last row, so only those after the last row delivered
are read, and counted, again on resume). Rows
are delivered in the order they arrive: in offset order within a partition, interleaved across
partitions as the client fetches them. Each row's `row_id` says where it came from::

    row_id = ((topic_index << 16) | partition) << 40 | offset   # topic_index: in `KafkaSource.topics`

When the source ends: with `until`, when every partition reached its end offset (a mapping
topic -> partition -> end offset, exclusive, or "end": the partition's end when the source reaches
it); with `idle_timeout_s`, when no message arrived for that long; the last batch may then be short.
With neither, the source keeps waiting for messages (continuous) until it is closed.

    source = KafkaSource(bootstrap_servers="127.0.0.1:9092", topics=["clicks"], message_format="json")
    mine = partitions_for(rank, world, topic_partitions(source))
    with open_kafka_reader(source, schema, batch_size=4096, partitions=mine, until="end") as reader:
        for batch in reader:
            train_step(batch)
            checkpoint_data = reader.position()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError
from confluent_kafka import TopicPartition as KafkaPartition

from psrec.data.background import InputGate, checkpoint
from psrec.data.batch import Batch
from psrec.data.errors import BadRows
from psrec.data.features import prepare_table, table_to_batch
from psrec.data.message_format import (
    AvroMessages,
    MessageDecoder,
)
from psrec.data.reader import BatchReader
from psrec.data.schema import PARTITION_BITS, KafkaSource, Schema
from psrec.data.units import OFFSET_BITS

logger = logging.getLogger(__name__)

POSITION_VERSION = 1
MAX_MESSAGES_PER_POLL = 10_000
METADATA_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 10.0

TopicPartition = tuple[str, int]
# Consumer errors that waiting does not mend (others, such as a broker down, are retried by the client).
_FATAL_CODES = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.OFFSET_OUT_OF_RANGE,
}
Until = Mapping[str, Mapping[Any, int]] | Literal["end"] | None


def partitions_for(
    trainer: int, num_trainers: int, partitions: Iterable[TopicPartition]
) -> list[TopicPartition]:
    """The partitions trainer `trainer` of `num_trainers` reads: every `num_trainers`-th of them in
    (topic, partition) order, starting at `trainer`. The trainers' shares are disjoint and together
    cover every partition; with more trainers than partitions, some get none."""
    if not 0 <= trainer < num_trainers:
        raise ValueError(f"trainer {trainer} is not one of {num_trainers} trainers")
    return sorted(set(partitions))[trainer::num_trainers]


def consumer_config(source: KafkaSource) -> dict[str, Any]:
    """The librdkafka settings the source's consumers run with (see `KafkaSource`)."""
    return {
        "group.id": "psrec",  # required by the client; never joined (assign) nor committed to
        "logger": logging.getLogger(f"{__name__}.librdkafka"),
        **source.client,
        "bootstrap.servers": source.bootstrap_servers,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "error",  # an offset no longer held raises, never silently jumps
    }


def topic_partitions(source: KafkaSource, timeout: float = METADATA_TIMEOUT_S) -> list[TopicPartition]:
    """Every (topic, partition) of the source's topics, from the broker's metadata. Asks for all
    topics, never one by name: some brokers create a topic that is asked for."""
    consumer = Consumer(consumer_config(source))
    try:
        metadata = consumer.list_topics(timeout=timeout)
    finally:
        consumer.close()
    found: list[TopicPartition] = []
    for topic in source.topics:
        if topic not in metadata.topics or metadata.topics[topic].error is not None:
            raise ValueError(f"topic {topic!r} does not exist on {source.bootstrap_servers}: create it first")
        found.extend((topic, partition) for partition in metadata.topics[topic].partitions)
    return sorted(found)


def position_offsets(position: Mapping[str, Any]) -> dict[TopicPartition, int]:
    """(topic, partition) -> next offset of a Kafka reader's position (partition keys as text or int)."""
    if position.get("format") != "kafka" or position.get("version") != POSITION_VERSION:
        raise ValueError(
            f"not a Kafka reader's position (format {position.get('format')!r}, version "
            f"{position.get('version')!r}; expected 'kafka', {POSITION_VERSION})"
        )
    return {
        (topic, int(partition)): int(offset)
        for topic, partitions in position["offsets"].items()
        for partition, offset in partitions.items()
    }


def kafka_position(offsets: Mapping[TopicPartition, int]) -> dict[str, Any]:
    """The JSON position of next offsets per (topic, partition) (see the module docstring)."""
    nested: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        nested.setdefault(topic, {})[str(partition)] = int(offset)
    return {"version": POSITION_VERSION, "format": "kafka", "offsets": nested}


def is_kafka_position(position: Any) -> bool:
    """True for a Kafka reader's position (see the module docstring)."""
    return isinstance(position, Mapping) and position.get("format") == "kafka"


def merge_positions(positions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One position holding every partition of `positions` (readers of disjoint partitions, e.g. the
    trainers of a run): a reader opened with it for any share of those partitions starts where
    their reader stood. Lets a stream run resume with another trainer count."""
    offsets: dict[TopicPartition, int] = {}
    for position in positions:
        for tp, offset in position_offsets(position).items():
            if tp in offsets and offsets[tp] != offset:
                raise ValueError(f"two readers stood at offsets {offsets[tp]} and {offset} of {tp}")
            offsets[tp] = offset
    newest = max((int(position.get("newest_event_ms", -1)) for position in positions), default=-1)
    merged = kafka_position(offsets)
    if newest >= 0:
        merged["newest_event_ms"] = newest
    return merged


def row_id_slot(topic_index: int, partition: int) -> int:
    """The high bits of the row ids of one partition (see the module docstring)."""
    if not 0 <= partition < 1 << PARTITION_BITS:
        raise ValueError(f"partition {partition} is beyond the row id layout's {1 << PARTITION_BITS}")
    return ((topic_index << PARTITION_BITS) | partition) << OFFSET_BITS


@dataclass
class _Block:
    """One poll's messages decoded: the prepared rows, and where every message (good or bad) was."""

    table: pa.Table | None  # prepared rows, in message order
    row_message: np.ndarray  # (rows,) index of each row's message
    slots: list[TopicPartition]  # (messages,) topic and partition of each message
    offsets: np.ndarray  # (messages,) offset of each message
    timestamps: np.ndarray  # (messages,) each message's timestamp, ms since the epoch (-1: none)

    @classmethod
    def empty(cls) -> _Block:
        """A poll that brought nothing: lets a batch that is not full be cut when it waited long."""
        nothing = np.zeros(0, np.int64)
        return cls(None, nothing, [], nothing, nothing)

    @property
    def num_rows(self) -> int:
        return self.table.num_rows if self.table is not None else 0

    def advance(self, passed: _Passed, start: int, stop: int) -> int:
        """Move `passed` past messages [start, stop) of the block; returns `stop`."""
        for index in range(start, stop):
            passed.offsets[self.slots[index]] = int(self.offsets[index]) + 1
        if stop > start:
            passed.newest_event_ms = max(passed.newest_event_ms, int(self.timestamps[start:stop].max()))
        return max(start, stop)


@dataclass
class _Passed:
    """Where a reader stands: the next offset of each partition, the newest message timestamp passed."""

    offsets: dict[TopicPartition, int]
    newest_event_ms: int = -1

    def position(self) -> dict[str, Any]:
        position = kafka_position(self.offsets)
        if self.newest_event_ms >= 0:
            position["newest_event_ms"] = self.newest_event_ms
        return position


def _batches(
    blocks: Iterator[_Block],
    start: _Passed,
    *,
    batch_size: int,
    drop_last: bool,
    max_delay_s: float | None = None,
) -> Iterator[tuple[pa.Table, dict[str, Any]]]:
    """Cut the blocks' rows into tables of `batch_size` rows, each with the position after it: past
    every message up to its last row's, bad messages among them included. With `max_delay_s`, rows
    that waited that long for their batch to fill are cut as a short batch (checked at every block,
    an empty one included)."""
    passed = _Passed(dict(start.offsets), start.newest_event_ms)
    pending: list[pa.Table] = []
    count = 0
    pending_since = 0.0
    for block in blocks:
        done = 0  # messages of the block that `passed` is past
        taken = 0
        while taken < block.num_rows:
            assert block.table is not None
            if not count:
                pending_since = time.monotonic()
            take = min(batch_size - count, block.num_rows - taken)
            pending.append(block.table.slice(taken, take))
            count += take
            taken += take
            if count == batch_size:
                done = block.advance(passed, done, int(block.row_message[taken - 1]) + 1)
                yield pa.concat_tables(pending), passed.position()
                pending, count = [], 0
        block.advance(passed, done, block.offsets.size)  # later batches are past its bad messages too
        if count and max_delay_s is not None and time.monotonic() - pending_since >= max_delay_s:
            yield pa.concat_tables(pending), passed.position()
            pending, count = [], 0
    if pending and not drop_last:
        yield pa.concat_tables(pending), passed.position()


class _Consumption:
    """Polls the assigned partitions and decodes each poll into a `_Block` until the source ends."""

    def __init__(
        self,
        source: KafkaSource,
        decoder: MessageDecoder,
        start: dict[TopicPartition, int],
        ends: dict[TopicPartition, int],
        *,
        until_end: bool,
        idle_timeout_s: float | None,
        max_messages: int,
    ) -> None:
        self.source = source
        self.decoder = decoder
        self.start = start
        self.ends = ends
        self.until_end = until_end
        self.idle_timeout_s = idle_timeout_s
        self.max_messages = max_messages
        self.slot_bases = {
            (topic, partition): row_id_slot(source.topics.index(topic), partition)
            for topic, partition in start
        }
        self.active = {tp for tp, offset in start.items() if tp not in ends or offset < ends[tp]}
        self.heads: dict[TopicPartition, int] = {}  # each partition's end as the last fetch saw it

    def _note_heads(self, consumer: Consumer) -> None:
        """Each partition's end offset as its last fetch reported it (no request to the broker)."""
        heads = dict(self.heads)
        for topic, partition in self.start:
            try:
                _, high = consumer.get_watermark_offsets(KafkaPartition(topic, partition), cached=True)
            except Exception:  # noqa: BLE001 - not fetched yet: no end known
                continue
            if high is not None and high >= 0:
                heads[(topic, partition)] = int(high)
        self.heads = heads  # replaced, never changed in place: read from other threads

    def blocks(self) -> Iterator[_Block]:
        if not self.active:
            return
        consumer = Consumer(consumer_config(self.source))
        try:
            consumer.assign([KafkaPartition(t, p, self.start[(t, p)]) for t, p in sorted(self.active)])
            last_message = time.monotonic()
            while self.active:
                checkpoint()  # a closed reader's prefetch thread stops here
                messages = consumer.consume(self.max_messages, timeout=self.source.poll_timeout_s)
                kept = [message for message in messages if self._keep(message, consumer)]
                self._note_heads(consumer)
                if kept:
                    last_message = time.monotonic()
                    yield self._decode(kept)
                elif (
                    self.idle_timeout_s is not None and time.monotonic() - last_message > self.idle_timeout_s
                ):
                    logger.info("no message for %.1f s: the stream source ends", self.idle_timeout_s)
                    return
                else:
                    yield _Block.empty()
        finally:
            consumer.close()

    def _finish(self, tp: TopicPartition, consumer: Consumer) -> None:
        if tp in self.active:
            self.active.discard(tp)
            consumer.pause([KafkaPartition(*tp)])

    def _keep(self, message: Any, consumer: Consumer) -> bool:
        """True for a message to decode; handles the end of partitions and the client's errors."""
        tp = (message.topic(), message.partition())
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                if self.until_end:
                    self._finish(tp, consumer)
                return False
            where = f"topic {tp[0]!r} partition {tp[1]}" if tp[0] else "the stream"
            if error.code() == KafkaError._AUTO_OFFSET_RESET:
                raise ValueError(
                    f"{where}: the offset to read is no longer on the broker ({error.str()}); the "
                    "position is older than the topic's retention: events were lost before psrec read them"
                )
            if error.fatal() or error.code() in _FATAL_CODES:
                raise RuntimeError(f"{where}: Kafka consumer error: {error.str()}")
            logger.warning("%s: Kafka consumer error (retried): %s", where, error.str())
            return False
        if tp not in self.active:
            return False  # fetched before its partition was paused
        end = self.ends.get(tp)
        if end is not None and message.offset() >= end:
            self._finish(tp, consumer)
            return False
        if end is not None and message.offset() + 1 >= end:
            self._finish(tp, consumer)
        return True

    def _decode(self, messages: list[Any]) -> _Block:
        slots = [(message.topic(), message.partition()) for message in messages]
        offsets = np.array([message.offset() for message in messages], dtype=np.int64)
        timestamps = np.array([message.timestamp()[1] for message in messages], dtype=np.int64)
        row_ids = np.array([self.slot_bases[slot] for slot in slots], dtype=np.int64) + offsets

        def locate(index: int) -> tuple[str, str]:
            topic, partition = slots[index]
            return f"topic {topic!r} partition {partition}", f"offset {int(offsets[index])}"

        table, kept = self.decoder.decode([message.value() for message in messages], row_ids, locate)
        if table is not None:
            table = prepare_table(self.decoder.schema, table, self.decoder.errors)
        return _Block(table, kept, slots, offsets, timestamps)


def _end_offsets(until: Until, partitions: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
    if until is None or until == "end":
        return {}
    ends = {}
    for topic, partition in partitions:
        named = until.get(topic, {})
        for key in (partition, str(partition)):
            if key in named:
                ends[(topic, partition)] = int(named[key])
    return ends


def open_kafka_reader(
    source: KafkaSource,
    schema: Schema,
    *,
    batch_size: int,
    partitions: Sequence[TopicPartition] | None = None,
    position: Mapping[str, Any] | None = None,
    until: Until = None,
    idle_timeout_s: float | None = None,
    max_batch_delay_s: float | None = None,
    prefetch: int = 2,
    drop_last: bool = False,
    gate: InputGate | None = None,
) -> BatchReader:
    """Read `partitions` (default: every partition of the source's topics) as batches of `batch_size`
    rows; see the module docstring.

    position: `reader.position()` of an earlier reader of the same topics (its other partitions are
    ignored). until: where each partition ends (exclusive offsets, topic -> partition -> offset;
    partitions not named do not end) or "end" (each partition's end when reached). idle_timeout_s:
    end when no message arrived for this long. max_batch_delay_s: rows that waited this long for
    their batch to fill are delivered as a short batch. prefetch, drop_last, gate: as `open_reader`'s.

    The reader's `stats()` adds `head_offsets` (topic -> partition -> end offset, as the last fetch
    saw it) and `events_behind` (the messages between the reader's position and those ends).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if idle_timeout_s is not None and idle_timeout_s <= 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    if max_batch_delay_s is not None and max_batch_delay_s <= 0:
        raise ValueError(f"max_batch_delay_s must be > 0, got {max_batch_delay_s}")
    assigned = sorted(set(partitions)) if partitions is not None else topic_partitions(source)
    if not assigned:
        raise ValueError("no partitions to read: more trainers than partitions? (see partitions_for)")
    unknown = sorted({topic for topic, _ in assigned} - set(source.topics))
    if unknown:
        raise ValueError(f"partitions of topics {unknown}, which are not the source's topics {source.topics}")
    earlier = position_offsets(position) if position is not None else {}
    start = {tp: earlier.get(tp, 0) for tp in assigned}
    newest = int(position.get("newest_event_ms", -1)) if position is not None else -1
    errors = BadRows(source.on_error)
    avro = None
    if source.avro_schema is not None:
        avro = AvroMessages(source.avro_schema, source.avro_framing, source.avro_schema_id)
    decoder = MessageDecoder(
        schema,
        source.message_format,
        errors,
        columns=source.columns,
        delimiter=source.delimiter,
        avro=avro,
    )
    consumption = _Consumption(
        source,
        decoder,
        start,
        _end_offsets(until, assigned),
        until_end=until == "end",
        idle_timeout_s=idle_timeout_s,
        max_messages=min(max(batch_size, 100), MAX_MESSAGES_PER_POLL),
    )

    def produce() -> Iterator[tuple[Batch, dict[str, Any]]]:
        for table, after in _batches(
            consumption.blocks(),
            _Passed(start, newest),
            batch_size=batch_size,
            drop_last=drop_last,
            max_delay_s=max_batch_delay_s,
        ):
            yield table_to_batch(schema, table), after

    def live(position: dict[str, Any]) -> dict[str, Any]:
        heads = consumption.heads
        read = position_offsets(position)
        behind = sum(max(0, end - read.get(tp, start[tp])) for tp, end in heads.items())
        return {"head_offsets": kafka_position(heads)["offsets"], "events_behind": behind}

    info = {"topics": list(source.topics), "partitions": [list(tp) for tp in assigned]}
    return BatchReader(
        produce,
        position=_Passed(start, newest).position(),
        prefetch=prefetch,
        errors=errors,
        info=info,
        gate=gate,
        live=live,
    )
