"""The rest of an epoch dealt to another number of readers (`psrec.data.shares.redistribute`).

Oracle: the row ids of the dataset as pyarrow / the file bytes give them, independent of the
reader. Readers read a random number of batches, then their positions (through JSON, as a
checkpoint keeps them) are redistributed to another reader count, several times; every row of the
dataset must be read exactly once in all.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.shares import redistribute
from psrec.data.synth import criteo_schema
from tests.data.test_parquet_reader import expected_row_ids

PARQUET = DataSource(format="parquet", paths=["*.parquet"])


def read_some(
    positions: list[dict[str, object]],
    base_dir: Path,
    rng: random.Random,
    *,
    shuffle_buffer: int,
    finish: bool,
) -> tuple[list[np.ndarray], list[dict[str, object]]]:
    """Each reader at its position reads 0-5 batches (all of its rest when `finish`)."""
    seen, after = [], []
    for shard, position in enumerate(positions):
        limit = None if finish else rng.randint(0, 5)
        with open_reader(
            PARQUET,
            criteo_schema(),
            batch_size=128,
            base_dir=base_dir,
            shard=shard,
            num_shards=len(positions),
            shuffle_buffer=shuffle_buffer,
            seed=7,
            position=position or None,
        ) as reader:
            for count, batch in enumerate(reader, start=1):
                seen.append(batch.row_ids)
                if limit is not None and count >= limit:
                    break
            after.append(json.loads(json.dumps(reader.position())))
    return seen, after


@pytest.mark.parametrize("shuffle_buffer", [0, 500])
@pytest.mark.parametrize("counts", [(2, 1), (1, 3), (2, 3, 1, 2)])
def test_every_row_is_read_once_across_changes_of_the_reader_count(
    synthetic_parquet: Path, shuffle_buffer: int, counts: tuple[int, ...]
) -> None:
    rng = random.Random(f"{shuffle_buffer}-{counts}")
    seen: list[np.ndarray] = []
    positions: list[dict[str, object]] = [{} for _ in range(counts[0])]
    for number, count in enumerate(counts):
        if number:
            positions = redistribute(positions, count)
            assert [p["shard"] for p in positions] == list(range(count))
        read, positions = read_some(
            positions, synthetic_parquet, rng, shuffle_buffer=shuffle_buffer, finish=number == len(counts) - 1
        )
        seen.extend(read)
    rows = np.concatenate(seen)
    expected = expected_row_ids(synthetic_parquet)
    assert rows.size == expected.size  # none twice
    assert np.array_equal(np.sort(rows), np.sort(expected))  # none left out


def test_a_reader_resumed_inside_a_redistributed_share_reads_its_rows_once(synthetic_parquet: Path) -> None:
    """A new reader's position, taken mid-share and reopened, continues exactly (a checkpoint)."""
    rng = random.Random(3)
    first, positions = read_some([{}, {}], synthetic_parquet, rng, shuffle_buffer=500, finish=False)
    positions = redistribute(positions, 1)
    middle, positions = read_some(positions, synthetic_parquet, rng, shuffle_buffer=500, finish=False)
    last, _ = read_some(positions, synthetic_parquet, rng, shuffle_buffer=500, finish=True)
    rows = np.concatenate(first + middle + last)
    expected = expected_row_ids(synthetic_parquet)
    assert rows.size == expected.size and np.array_equal(np.sort(rows), np.sort(expected))


def test_the_shares_are_balanced_to_a_unit_and_checked() -> None:
    start = {"version": 1, "format": "parquet", "seed": 0, "shuffle_buffer": 0, "num_shards": 1}
    position = {**start, "shard": 0, "num_units": 21, "window": 0, "unit": 0, "after": None, "consumed": 0}
    shares = redistribute([position], 4)
    sizes = [p["num_units"] for p in shares]
    assert sum(sizes) == 21 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        redistribute([position], 0)
    with pytest.raises(ValueError, match="different epochs or data"):
        redistribute([position, {**position, "seed": 1, "shard": 1}], 1)
