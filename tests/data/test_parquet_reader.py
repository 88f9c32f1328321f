"""Parquet reading: batch contents, sharding + exact resume, shuffle, prefetch, bad rows."""

import contextlib
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psrec.data.errors import BadRowError
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SequenceFeature, SparseFeature
from psrec.data.synth import criteo_schema
from psrec.data.units import OFFSET_BITS

PARQUET = DataSource(format="parquet", paths=["*.parquet"])


def expected_row_ids(directory: Path) -> np.ndarray:
    files = sorted(directory.glob("*.parquet"))
    return np.concatenate(
        [
            (index << OFFSET_BITS) + np.arange(pq.ParquetFile(f).metadata.num_rows)
            for index, f in enumerate(files)
        ]
    )


def test_batches_follow_the_schema(synthetic_parquet: Path) -> None:
    schema = criteo_schema()
    with open_reader(PARQUET, schema, batch_size=256, base_dir=synthetic_parquet) as reader:
        batch = next(iter(reader))
    assert batch.labels.shape == (256,) and batch.labels.dtype == np.float32
    assert set(np.unique(batch.labels).tolist()) <= {0.0, 1.0}
    assert batch.dense.shape == (256, 13) and batch.dense.dtype == np.float32
    assert np.isfinite(batch.dense).all() and (batch.dense >= 0).all()
    assert batch.sparse.keys == tuple(f"C{i}" for i in range(1, 27))
    assert batch.sparse.batch_size == 256 and (batch.sparse.lengths == 1).all()
    assert batch.row_ids.tolist() == list(range(256))
    table = pq.read_table(sorted(synthetic_parquet.glob("*.parquet"))[0]).slice(0, 256)
    expected = np.log1p(table.column("I5").to_numpy(zero_copy_only=False).astype(float))
    np.testing.assert_allclose(batch.dense[:, 4], np.nan_to_num(expected, nan=0.0), rtol=1e-6)


def test_every_row_once_in_order_without_shuffle(harness: SimpleNamespace, synthetic_parquet: Path) -> None:
    rows = harness.read_all(PARQUET, criteo_schema(), synthetic_parquet, batch_size=512)
    assert rows.tolist() == expected_row_ids(synthetic_parquet).tolist()
    dropped = harness.read_all(PARQUET, criteo_schema(), synthetic_parquet, batch_size=512, drop_last=True)
    assert dropped.size == 6000 // 512 * 512


@pytest.mark.parametrize("shuffle_buffer", [0, 700])
def test_sharded_resume_is_exactly_once(
    harness: SimpleNamespace, synthetic_parquet: Path, shuffle_buffer: int
) -> None:
    harness.check_sharded_resume(
        PARQUET,
        criteo_schema(),
        synthetic_parquet,
        expected_row_ids(synthetic_parquet),
        seed=shuffle_buffer,
        batch_size=250,
        shuffle_buffer=shuffle_buffer,
    )


def test_shuffle_is_deterministic_bounded_and_seeded(
    harness: SimpleNamespace, synthetic_parquet: Path
) -> None:
    options = {"batch_size": 1000, "shuffle_buffer": 600}
    first = harness.read_all(PARQUET, criteo_schema(), synthetic_parquet, seed=1, **options)
    again = harness.read_all(PARQUET, criteo_schema(), synthetic_parquet, seed=1, **options)
    other = harness.read_all(PARQUET, criteo_schema(), synthetic_parquet, seed=2, **options)
    assert first.tolist() == again.tolist()
    assert first.tolist() != other.tolist()
    assert sorted(first.tolist()) == sorted(other.tolist()) == expected_row_ids(synthetic_parquet).tolist()
    assert first.tolist() != sorted(first.tolist())


def test_position_is_checked_against_the_reader(synthetic_parquet: Path) -> None:
    with open_reader(PARQUET, criteo_schema(), batch_size=100, base_dir=synthetic_parquet, seed=1) as reader:
        next(iter(reader))
        position = json.loads(json.dumps(reader.position()))
    with pytest.raises(ValueError, match="num_shards"):
        open_reader(
            PARQUET,
            criteo_schema(),
            batch_size=100,
            base_dir=synthetic_parquet,
            seed=1,
            num_shards=2,
            position=position,
        )


def test_close_stops_the_prefetch_thread(synthetic_parquet: Path) -> None:
    reader = open_reader(PARQUET, criteo_schema(), batch_size=64, base_dir=synthetic_parquet, prefetch=2)
    iterator = iter(reader)
    next(iterator)
    assert any(thread.name == "psrec-prefetch" for thread in threading.enumerate())
    reader.close()
    assert not any(thread.name == "psrec-prefetch" for thread in threading.enumerate())
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(reader)


def test_prefetch_and_synchronous_reading_agree(harness: SimpleNamespace, synthetic_parquet: Path) -> None:
    synchronous = harness.read_all(
        PARQUET, criteo_schema(), synthetic_parquet, batch_size=300, prefetch=0, shuffle_buffer=500
    )
    prefetched = harness.read_all(
        PARQUET, criteo_schema(), synthetic_parquet, batch_size=300, prefetch=4, shuffle_buffer=500
    )
    assert synchronous.tolist() == prefetched.tolist()


def test_a_gated_reader_pausing_mid_row_group_reads_the_same_batches(synthetic_parquet: Path) -> None:
    """Under an input gate the prefetch thread decodes row groups in column groups, pausing at
    checkpoints while the consumer holds the gate (as the in-process trainer does): same batches."""
    from psrec.data.background import InputGate

    def read(gate: InputGate | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        out = []
        with open_reader(
            PARQUET, criteo_schema(), batch_size=300, base_dir=synthetic_parquet, prefetch=2, gate=gate
        ) as reader:
            batches = iter(reader)
            with gate.held() if gate is not None else contextlib.nullcontext():
                while True:
                    # The trainer's pattern: it holds the gate through its step (the reader pauses at
                    # its next checkpoint) and gives it up while it waits for a batch.
                    with gate.released() if gate is not None else contextlib.nullcontext():
                        batch = next(batches, None)
                    if batch is None:
                        return out
                    out.append((batch.row_ids, batch.dense, batch.sparse.ids))
                    time.sleep(0.002)  # the step

    plain, gated = read(None), read(InputGate())
    assert len(plain) == len(gated) > 1
    for (rows_a, dense_a, ids_a), (rows_b, dense_b, ids_b) in zip(plain, gated, strict=True):
        np.testing.assert_array_equal(rows_a, rows_b)
        np.testing.assert_array_equal(dense_a, dense_b)
        np.testing.assert_array_equal(ids_a, ids_b)


def test_multi_valued_sequences_and_missing_labels(harness: SimpleNamespace, tmp_path: Path) -> None:
    table = pa.table(
        {
            "y": pa.array([1.0, 0.0, None, 1.0]),
            "age": pa.array([30.0, None, 5.0, float("nan")]),
            "item": pa.array([3, 4, 5, 6], pa.int64()),
            "tags": pa.array(["a|b", "", None, "c"]),
            "history": pa.array([[1, 2, 3], [], [4], None], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    schema = Schema(
        label="y",
        dense=[DenseFeature(name="age", fill=-1.0)],
        sparse=[
            SparseFeature(name="item", table="items", hashed=False),
            SparseFeature(name="tags", table="tags", multi_valued=True),
        ],
        sequences=[SequenceFeature(name="history", table="items", max_length=2, hashed=False)],
    )
    source = DataSource(format="parquet", paths=["t.parquet"])
    with pytest.raises(BadRowError, match=r"t.parquet, row 2: missing label 'y'"):
        harness.read_all(source, schema, tmp_path, batch_size=10)
    skip = source.model_copy(update={"on_error": "skip"})
    with open_reader(skip, schema, batch_size=10, base_dir=tmp_path) as reader:
        batch = next(iter(reader))
        stats = reader.stats()
    assert stats["rows_skipped"] == 1 and stats["skipped_samples"][0]["location"] == "row 2"
    assert batch.row_ids.tolist() == [0, 1, 3]
    assert batch.dense[:, 0].tolist() == [30.0, -1.0, -1.0]
    assert batch.sparse.feature("item")[0].tolist() == [3, 4, 6]
    assert batch.sparse.feature("tags")[1].tolist() == [2, 0, 1]
    history = batch.sequences["history"]
    assert history.ids.tolist() == [[2, 3], [0, 0], [0, 0]]
    assert history.mask.tolist() == [[True, True], [False, False], [False, False]]


def test_shared_namespace_gives_shared_ids(tmp_path: Path) -> None:
    table = pa.table({"y": [1, 0], "item": ["a", "b"], "history": ["b|a|c", "a"], "query": ["a", "b"]})
    pq.write_table(table, tmp_path / "t.parquet")
    schema = Schema(
        label="y",
        sparse=[
            SparseFeature(name="item", table="items", namespace="item"),
            SparseFeature(name="query", table="items"),  # own namespace: other ids for the same text
        ],
        sequences=[SequenceFeature(name="history", table="items", max_length=3, namespace="item")],
    )
    with open_reader(
        DataSource(format="parquet", paths=["t.parquet"]), schema, batch_size=2, base_dir=tmp_path
    ) as reader:
        (batch,) = list(reader)
        assert reader.stats()["shard_rows"] == 2
    item_a, item_b = batch.sparse.feature("item")[0].tolist()
    assert batch.sequences["history"].ids.tolist() == [
        [item_b, item_a, batch.sequences["history"].ids[0, 2]],
        [0, 0, item_a],
    ]
    assert not set(batch.sparse.feature("query")[0].tolist()) & {item_a, item_b}
