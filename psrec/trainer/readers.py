"""What a trainer reads of its share of the data: the reader of an epoch's training source (files,
files as they land, a Kafka stream), the bad-input counters that reader reports chunk by chunk, and
an evaluation split scored by the trainer's model (CTR scores and labels, or the ranks of held-out
items for the ranking models).

`psrec.trainer.worker.TrainerWorker` calls these with its own share (`shard` of `num_shards`) and its
runner's `predict`; nothing here holds a model or a client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from psrec.allocator import release_free_memory
from psrec.config import RunConfig
from psrec.data.background import InputGate
from psrec.data.growing_source import open_growing_reader
from psrec.data.kafka_source import KafkaSource, open_kafka_reader, partitions_for, topic_partitions
from psrec.data.reader import PreparedCache, open_reader
from psrec.data.schema import DataSource

if TYPE_CHECKING:
    from psrec.data.batch import Batch
    from psrec.data.sequences import InteractionData

# The reader's counters of bad input (`BatchReader.stats`) that travel to the driver's summary.
INPUT_COUNTS = (
    "rows_skipped",
    "units_failed",
    "bytes_lost",
    "rows_lost",
    "dense_values_filled",
    "dense_values_clipped",
)


def parse_sources(data_sources: dict[str, dict[str, Any]]) -> dict[str, DataSource | KafkaSource]:
    """The sources of each split, validated from the JSON the driver hands its trainers."""
    return {
        split: KafkaSource.model_validate(source)
        if source.get("format") == "kafka"
        else DataSource.model_validate(source)
        for split, source in data_sources.items()
    }


def open_training_reader(
    config: RunConfig,
    source: DataSource | KafkaSource,
    *,
    epoch: int,
    shard: int,
    num_shards: int,
    position: dict[str, Any] | None,
    base_dir: Path,
    gate: InputGate | None,
    cache: PreparedCache | None,
) -> Any:
    """The reader of `shard` of `num_shards` of the training `source` for `epoch`, from `position`:
    a Kafka stream (read to its end, or followed under ``training.mode: continuous``), files followed
    as they land (``growing``), or files (shuffled per epoch, cached as ``training.cache_data`` says)."""
    training = config.training
    if isinstance(source, KafkaSource):
        continuous = training.mode == "continuous"
        return open_kafka_reader(
            source,
            config.feature_schema(),
            batch_size=training.batch_size,
            partitions=partitions_for(shard, num_shards, topic_partitions(source)),
            position=position,
            until=None if continuous else "end",  # bounded: each partition read to its end
            idle_timeout_s=training.stream.stop_after_idle_s if continuous else None,
            max_batch_delay_s=training.stream.batch_timeout_s if continuous else None,
            gate=gate,
        )
    if source.growing is not None:  # files read as they land (training.mode continuous)
        return open_growing_reader(
            source,
            config.feature_schema(),
            batch_size=training.batch_size,
            shard=shard,
            num_shards=num_shards,
            growing=source.growing,
            position=position,
            max_batch_delay_s=training.stream.batch_timeout_s,
            idle_timeout_s=training.stream.stop_after_idle_s,
            base_dir=base_dir,
            gate=gate,
        )
    return open_reader(
        source,
        config.feature_schema(),
        batch_size=training.batch_size,
        base_dir=base_dir,
        shard=shard,
        num_shards=num_shards,
        shuffle_buffer=training.shuffle_buffer,
        seed=training.seed * 1000 + epoch,
        position=position,
        gate=gate,
        cache=cache,
    )


class InputReport:
    """A reader's bad-input counters and failed units since the last report (one epoch's reader)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # the reader's counters already reported
        self.failed = 0

    def since_last(self, stats: dict[str, Any]) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """The counters and failed units of `stats` (the reader's now) not reported yet."""
        counts = {key: int(stats.get(key) or 0) for key in INPUT_COUNTS}
        delta = {key: value - self.counts.get(key, 0) for key, value in counts.items()}
        failed = list(stats.get("failed_units") or [])
        new_failed = failed[self.failed :]
        self.counts, self.failed = counts, len(failed)
        return delta, new_failed


def stream_lag(stats: dict[str, Any], position: dict[str, Any]) -> dict[str, int]:
    """A stream's lag from its reader's `stats` and `position`: messages behind the partitions' ends
    (for growing files, the files not read yet) and the newest event trained (for files: the newest
    file's time)."""
    return {
        "events_behind": int(stats.get("events_behind", 0)),
        "files_behind": int(stats.get("files_pending", 0)),
        "newest_event_ms": int(position.get("newest_event_ms") or -1),
    }


def score_batches(batches: Iterable[Batch], predict: Callable[[Batch], np.ndarray]) -> dict[str, np.ndarray]:
    """CTR evaluation: {"scores", "labels"} of every row of `batches`, giving malloc's freed blocks
    back after each batch (`psrec.allocator`)."""
    scores, labels = [], []
    for batch in batches:
        scores.append(predict(batch))
        labels.append(batch.labels)
        release_free_memory(pools=False)  # this batch's freed blocks, before the next batch's
    if not scores:  # this trainer's share of a small split may be empty
        return {"scores": np.zeros(0, np.float32), "labels": np.zeros(0, np.float32)}
    return {"scores": np.concatenate(scores), "labels": np.concatenate(labels)}


def load_training_interactions(source: DataSource, base_dir: Path) -> InteractionData:
    """The users' interaction sequences of the training files (the ranking models' evaluation holds
    items of them out)."""
    from psrec.data.sequences import load_interactions
    from psrec.data.units import expand_paths, local_files

    return load_interactions(local_files(expand_paths(source.paths, base_dir)))


def rank_held_out(
    interactions: InteractionData,
    predict: Callable[[Batch], np.ndarray],
    *,
    config: RunConfig,
    split: str,
    shard: int,
    num_shards: int,
    holdout: str,
) -> dict[str, np.ndarray]:
    """Ranking evaluation of the users in `shard` of `num_shards`: {"ranks"} of each held-out item of
    `split` among its 100 sampled negatives, and with ``training.full_ranking`` {"full_ranks"} among
    all items, the user's input items excluded (`psrec.data.sequences.full_ranking_batches`)."""
    from psrec.data.sequences import evaluation_batches, full_ranking_batches
    from psrec.trainer.metrics import full_ranks, sampled_ranks

    max_length = next(f.max_length for f in config.feature_schema().sequences if f.name == "seq")
    users = dict(
        split="valid" if split == "validation" else "test",
        max_length=max_length,
        batch_size=config.training.eval_batch_size,
        shard=shard,
        num_shards=num_shards,
        holdout=holdout,
    )
    batches = evaluation_batches(interactions, seed=config.training.seed, **users)  # type: ignore[arg-type]
    ranks = [sampled_ranks(predict(batch)) for batch in batches]
    out = {"ranks": np.concatenate(ranks) if ranks else np.zeros(0, np.int64)}
    if config.training.full_ranking:
        full = [
            full_ranks(predict(users_batch.batch), users_batch.targets, seen=users_batch.seen)
            for users_batch in full_ranking_batches(interactions, **users)  # type: ignore[arg-type]
        ]
        out["full_ranks"] = np.concatenate(full) if full else np.zeros(0, np.int64)
    return out
