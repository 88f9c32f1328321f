"""`PreparedCache` (training.cache_data): later epochs are served from memory and equal a fresh read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.data.batch import Batch
from psrec.data.parquet_format import ParquetFormat
from psrec.data.reader import PreparedCache, open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import criteo_schema
from tests.data.test_sequences import write_interactions

PARQUET = DataSource(format="parquet", paths=["*.parquet"])


def _epoch(directory: Path, **options: Any) -> list[Batch]:
    options = {"batch_size": 700, "base_dir": directory, **options}
    with open_reader(PARQUET, criteo_schema(), **options) as reader:
        return list(reader)


def _assert_same(got: list[Batch], expected: list[Batch]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.row_ids is not None and b.row_ids is not None
        np.testing.assert_array_equal(a.row_ids, b.row_ids)
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.dense, b.dense)
        np.testing.assert_array_equal(a.sparse.ids, b.sparse.ids)
        np.testing.assert_array_equal(a.sparse.lengths, b.sparse.lengths)


@pytest.mark.parametrize("shuffle_buffer", [0, 1500])
def test_cached_epochs_equal_fresh_reads_without_reading_the_files_again(
    synthetic_parquet: Path, shuffle_buffer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    original = ParquetFormat.read

    def counting(self: ParquetFormat, unit: Any, after: int | None) -> Any:
        reads.append(unit.row_group)
        return original(self, unit, after)

    monkeypatch.setattr(ParquetFormat, "read", counting)
    cache = PreparedCache()
    options = {"shuffle_buffer": shuffle_buffer, "cache": cache}
    first = _epoch(synthetic_parquet, seed=1000, **options)
    units = len(reads)
    assert units > 1 and len(cache) == units and cache.nbytes > 0
    _assert_same(first, _epoch(synthetic_parquet, seed=1000, shuffle_buffer=shuffle_buffer))
    assert len(reads) == 2 * units  # the uncached read does read the files

    second = _epoch(synthetic_parquet, seed=1001, **options)  # a new epoch: new shuffle, no file read
    assert len(reads) == 2 * units
    _assert_same(second, _epoch(synthetic_parquet, seed=1001, shuffle_buffer=shuffle_buffer))
    if shuffle_buffer:
        assert first[0].row_ids.tolist() != second[0].row_ids.tolist()  # type: ignore[union-attr]


def test_a_reader_closed_midway_caches_only_whole_units_and_resume_still_matches(
    synthetic_parquet: Path,
) -> None:
    cache = PreparedCache()
    options: dict[str, Any] = {"seed": 3, "shuffle_buffer": 900, "cache": cache}
    with open_reader(
        PARQUET, criteo_schema(), batch_size=700, base_dir=synthetic_parquet, **options
    ) as reader:
        iterator = iter(reader)
        taken = [next(iterator) for _ in range(2)]
        position = reader.position()
    whole = len(cache)
    expected = _epoch(synthetic_parquet, seed=3, shuffle_buffer=900)
    assert 0 < whole < 21  # of 21 units: those left unread (or half read) are not in the cache

    # Resuming mid-window with the cache gives the rest of the epoch exactly as without it.
    rest = _epoch(synthetic_parquet, position=position, **options)
    _assert_same(taken + rest, expected)


def test_interactions_are_never_cached(tmp_path: Path) -> None:
    from psrec.data.sequences import sasrec_schema

    write_interactions(tmp_path / "i.txt")
    source = DataSource(format="interactions", paths=["i.txt"])
    cache = PreparedCache()
    with open_reader(
        source, sasrec_schema(max_length=10), batch_size=32, base_dir=tmp_path, cache=cache
    ) as reader:
        assert sum(batch.batch_size for batch in reader) > 0
    assert len(cache) == 0
