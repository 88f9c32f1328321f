"""Shared fixtures of the input-pipeline tests: small generated datasets (never the real data); the
Kafka broker of the stream sources' tests is `kafka_broker` in tests/conftest.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, Schema
from psrec.data.synth import write_synthetic_criteo


@pytest.fixture(scope="session")
def synthetic_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 Parquet files, 2,000 rows, row groups of 300 rows (7 units per file)."""
    directory = tmp_path_factory.mktemp("synthetic_parquet")
    write_synthetic_criteo(directory, rows=6000, files=3, seed=1, cardinality_scale=0.001, row_group_rows=300)
    return directory


@pytest.fixture(scope="session")
def synthetic_tsv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of rows as Criteo raw TSV: 2 files of 1,500 rows."""
    directory = tmp_path_factory.mktemp("synthetic_tsv")
    write_synthetic_criteo(directory, rows=3000, files=2, seed=2, format="tsv", cardinality_scale=0.001)
    return directory


def read_all(source: DataSource, schema: Schema, base_dir: Path, **options: object) -> np.ndarray:
    with open_reader(source, schema, base_dir=base_dir, **options) as reader:  # type: ignore[arg-type]
        return np.concatenate([batch.row_ids for batch in reader] or [np.zeros(0, np.int64)])


def read_with_restarts(
    source: DataSource, schema: Schema, base_dir: Path, rng: random.Random, **options: object
) -> np.ndarray:
    """Read a shard, stopping after a random number of batches and resuming from the position."""
    seen: list[np.ndarray] = []
    position = None
    while True:
        stop_after = rng.randint(0, 3)
        with open_reader(source, schema, base_dir=base_dir, position=position, **options) as reader:  # type: ignore[arg-type]
            finished = True
            for count, batch in enumerate(reader, start=1):
                seen.append(batch.row_ids)
                if count > stop_after:
                    finished = False
                    break
            position = json.loads(json.dumps(reader.position()))  # what a checkpoint stores
        if finished:
            return np.concatenate(seen or [np.zeros(0, np.int64)])


def check_sharded_resume(
    source: DataSource, schema: Schema, base_dir: Path, expected: np.ndarray, *, seed: int, **options: object
) -> None:
    """For N in {1, 2, 3}: restarts give each shard's uninterrupted order; the union is the dataset once."""
    rng = random.Random(seed)
    for num_shards in (1, 2, 3):
        union = []
        for shard in range(num_shards):
            sharded = {**options, "shard": shard, "num_shards": num_shards}
            straight = read_all(source, schema, base_dir, **sharded)
            restarted = read_with_restarts(source, schema, base_dir, rng, **sharded)
            assert restarted.tolist() == straight.tolist(), (num_shards, shard)
            if num_shards > 1:
                assert straight.size > 0, f"shard {shard} of {num_shards} is empty: make the test data bigger"
            union.append(straight)
        everything = np.concatenate(union)
        assert everything.size == expected.size, num_shards
        assert sorted(everything.tolist()) == sorted(expected.tolist()), num_shards


@pytest.fixture(scope="session")
def harness() -> SimpleNamespace:
    """`read_all`, `read_with_restarts`, `check_sharded_resume` for the tests of every format."""
    return SimpleNamespace(
        read_all=read_all, read_with_restarts=read_with_restarts, check_sharded_resume=check_sharded_resume
    )
