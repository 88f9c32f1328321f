"""Bad Parquet input: ids beyond int64, columns of the wrong type, non-binary labels, non-finite dense
values (raw and prepared files), a row group that cannot be decoded, a file without rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psrec.data.errors import BadRowError
from psrec.data.features import ROW_ID, mark_prepared, prepare_table, schema_fingerprint, table_to_batch
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SequenceFeature, SparseFeature

SOURCE = DataSource(format="parquet", paths=["t.parquet"])
SCHEMA = Schema(
    label="y",
    dense=[DenseFeature(name="x", fill=-1.0)],
    sparse=[
        SparseFeature(name="item", table="items", hashed=False),
        SparseFeature(name="tags", table="tags", hashed=False, multi_valued=True),
    ],
)


def read(
    source: DataSource, schema: Schema, base_dir: Path, **options: Any
) -> tuple[list[Any], dict[str, Any]]:
    with open_reader(source, schema, batch_size=1 << 20, base_dir=base_dir, **options) as reader:
        batches = list(reader)
        return batches, reader.stats()


def write(tmp_path: Path, **columns: pa.Array) -> None:
    base = {
        "y": pa.array([1.0, 0.0, 1.0, 0.0]),
        "x": pa.array([1.0, 2.0, 3.0, 4.0]),
        "item": pa.array([1, 2, 3, 4], pa.uint64()),
        "tags": pa.array([[1], [], [2, 3], [4]], pa.list_(pa.uint64())),
    }
    pq.write_table(pa.table({**base, **columns}), tmp_path / "t.parquet")


@pytest.mark.parametrize(
    ("column", "reason"),
    [
        ("item", r"item: id 18446744073709551615 outside \[0, 2\*\*48\)"),
        ("tags", r"tags: id 18446744073709551615 outside \[0, 2\*\*48\)"),
    ],
)
def test_uint64_ids_above_int64_name_file_row_and_column_and_honour_on_error(
    tmp_path: Path, column: str, reason: str
) -> None:
    huge = (1 << 64) - 1
    if column == "item":
        write(tmp_path, item=pa.array([1, huge, 3, 4], pa.uint64()))
    else:
        write(tmp_path, tags=pa.array([[1], [huge], [2, 3], [4]], pa.list_(pa.uint64())))
    with pytest.raises(BadRowError, match=rf"t.parquet, row 1: {reason}"):
        read(SOURCE, SCHEMA, tmp_path)
    (batch,), stats = read(SOURCE.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)
    assert batch.row_ids.tolist() == [0, 2, 3] and stats["rows_skipped"] == 1
    assert batch.sparse.feature("item")[0].tolist() == [1, 3, 4]


def test_pass_through_ids_that_are_not_integers_are_bad_rows(tmp_path: Path) -> None:
    write(tmp_path, item=pa.array([1.0, 2.5, 3.0, -4.0]))
    with pytest.raises(BadRowError, match=r"t.parquet, row 1: item: id 2.5 is not an integer"):
        read(SOURCE, SCHEMA, tmp_path)
    (batch,), stats = read(SOURCE.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)
    assert batch.sparse.feature("item")[0].tolist() == [1, 3] and stats["rows_skipped"] == 2


def test_a_column_of_the_wrong_type_names_the_file_and_column(tmp_path: Path) -> None:
    write(tmp_path, y=pa.array(["1", "0", "1", "0"]))
    with pytest.raises(ValueError, match=r"t.parquet: column 'y' is string, expected numbers"):
        read(SOURCE.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)


def test_labels_must_be_0_or_1(tmp_path: Path) -> None:
    write(tmp_path, y=pa.array([1.0, float("nan"), 2.0, 0.0]))
    with pytest.raises(BadRowError, match=r"t.parquet, row 1: label 'y' is nan: expected 0 or 1"):
        read(SOURCE, SCHEMA, tmp_path)
    (batch,), stats = read(SOURCE.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)
    assert batch.row_ids.tolist() == [0, 3] and stats["rows_skipped"] == 2
    write(tmp_path, y=pa.array([True, False, True, False]))  # booleans are labels too
    (batch,), _ = read(SOURCE, SCHEMA, tmp_path)
    assert batch.labels.tolist() == [1, 0, 1, 0]


def test_non_finite_dense_values_are_filled_and_counted(tmp_path: Path) -> None:
    write(tmp_path, x=pa.array([float("nan"), None, float("-inf"), 1e300]))
    (batch,), stats = read(SOURCE, SCHEMA, tmp_path)
    assert batch.dense[:, 0].tolist() == [-1, -1, -1, np.finfo(np.float32).max]
    assert stats["dense_values"] == {"x": {"missing": 1, "filled": 2, "clipped": 1}}
    raising = SCHEMA.model_copy(update={"dense": [DenseFeature(name="x", invalid="raise")]})
    with pytest.raises(BadRowError, match=r"t.parquet, row 0: dense feature 'x' is nan"):
        read(SOURCE, raising, tmp_path)


def _prepared_file(tmp_path: Path, schema: Schema, dense: list[float], labels: list[float]) -> None:
    raw = pa.table(
        {
            "y": pa.array([1.0] * len(dense)),
            "x": pa.array([1.0] * len(dense)),
            "item": pa.array(list(range(len(dense))), pa.int64()),
            "tags": pa.array([[1]] * len(dense), pa.list_(pa.int64())),
            ROW_ID: pa.array(list(range(len(dense))), pa.int64()),
        }
    )
    table = prepare_table(schema, raw).drop_columns([ROW_ID])
    table = table.set_column(0, "y", pa.array(labels, pa.float32()))
    table = table.set_column(1, "x", pa.array(dense, pa.float32()))
    pq.write_table(mark_prepared(table, schema_fingerprint(schema)), tmp_path / "t.parquet")


def test_prepared_files_with_non_finite_values_or_bad_labels_are_refused(tmp_path: Path) -> None:
    _prepared_file(tmp_path, SCHEMA, [1.0, float("inf"), 2.0, 3.0], [1.0, 0.0, float("nan"), 0.0])
    with pytest.raises(BadRowError, match=r"t.parquet, row 1: prepared dense feature 'x' is inf; prepare"):
        read(SOURCE, SCHEMA, tmp_path)
    (batch,), stats = read(SOURCE.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)
    assert batch.row_ids.tolist() == [0, 3] and stats["rows_skipped"] == 2
    assert np.isfinite(batch.dense).all()


def test_a_batch_never_holds_a_non_finite_value() -> None:
    schema = Schema(label="y", dense=[DenseFeature(name="x")])
    table = pa.table(
        {
            "y": pa.array([1.0, 0.0], pa.float32()),
            "x": pa.array([1.0, float("nan")], pa.float32()),
            ROW_ID: pa.array([5, (1 << 40) + 7]),
        }
    )
    with pytest.raises(
        ValueError, match=r"non-finite dense value reached a batch \(file #1 of the source, offset 7\)"
    ):
        table_to_batch(schema, table)


def test_a_row_group_that_cannot_be_decoded_is_a_failed_unit(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table = pa.table({"y": pa.array(rng.integers(0, 2, 3000).astype(float)), "x": pa.array(rng.random(3000))})
    pq.write_table(
        table, tmp_path / "t.parquet", row_group_size=1000, compression="zstd", use_dictionary=False
    )
    chunk = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(1).column(1)
    data = bytearray((tmp_path / "t.parquet").read_bytes())
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    data[middle : middle + 200] = bytes(200)
    (tmp_path / "t.parquet").write_bytes(bytes(data))
    schema = Schema(label="y", dense=[DenseFeature(name="x")])
    with pytest.raises(BadRowError, match=r"t.parquet, row group 1 \(rows 1000-1999\): unreadable"):
        read(SOURCE, schema, tmp_path)
    (batch,), stats = read(SOURCE.model_copy(update={"on_error": "skip"}), schema, tmp_path)
    assert batch.batch_size == 2000 and stats["rows_skipped"] == 0
    assert (stats["units_failed"], stats["rows_lost"]) == (1, 1000) and stats["bytes_lost"] > 0


def test_a_parquet_file_without_rows_is_an_error_unless_allowed(tmp_path: Path) -> None:
    write(tmp_path)
    empty = pa.table({"y": pa.array([], pa.float64()), "x": pa.array([], pa.float64())})
    pq.write_table(empty, tmp_path / "empty.parquet")
    schema = Schema(label="y", dense=[DenseFeature(name="x")])
    source = DataSource(format="parquet", paths=["t.parquet", "empty.parquet"])
    with pytest.raises(BadRowError, match=r"empty.parquet, file: the file has no rows: .*allow_empty: true"):
        read(source, schema, tmp_path)
    (batch,), _ = read(source.model_copy(update={"allow_empty": True}), schema, tmp_path)
    assert batch.batch_size == 4


def test_sequences_of_uint64_ids_are_checked_too(tmp_path: Path) -> None:
    write(tmp_path, history=pa.array([[1, 2], [(1 << 64) - 1], [], [3]], pa.list_(pa.uint64())))
    schema = SCHEMA.model_copy(
        update={"sequences": [SequenceFeature(name="history", table="items", max_length=2, hashed=False)]}
    )
    with pytest.raises(BadRowError, match=r"t.parquet, row 1: history: id 18446744073709551615 outside"):
        read(SOURCE, schema, tmp_path)


def test_an_unreadable_parquet_file_is_a_failed_unit_not_a_skipped_row(tmp_path: Path) -> None:
    write(tmp_path)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    source = DataSource(format="parquet", paths=["t.parquet", "broken.parquet"])
    with pytest.raises(BadRowError, match=r"broken.parquet, file: unreadable Parquet file"):
        read(source, SCHEMA, tmp_path)
    (batch,), stats = read(source.model_copy(update={"on_error": "skip"}), SCHEMA, tmp_path)
    assert batch.batch_size == 4 and stats["rows_skipped"] == 0
    assert stats["units_failed"] == 1 and stats["bytes_lost"] == 15
    assert stats["failed_units"][0]["file"] == str(tmp_path / "broken.parquet")
