"""Prepared Parquet (`psrec data convert --prepared`): the same batches as the raw rows, tied to its schema."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from psrec.cli import main
from psrec.config import parse_config
from psrec.data.batch import Batch
from psrec.data.convert import convert_to_parquet
from psrec.data.features import PREPARED_KEY, schema_fingerprint
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema
from psrec.data.synth import criteo_schema
from psrec.train.data_sources import prepare_data


def read(source: DataSource, schema: Schema, base_dir: Path, **options: object) -> list[Batch]:
    with open_reader(source, schema, batch_size=256, base_dir=base_dir, **options) as reader:  # type: ignore[arg-type]
        return list(reader)


def assert_same_batches(left: list[Batch], right: list[Batch]) -> None:
    assert len(left) == len(right) > 0
    for a, b in zip(left, right, strict=True):
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.dense, b.dense)
        np.testing.assert_array_equal(a.sparse.ids, b.sparse.ids)
        np.testing.assert_array_equal(a.sparse.lengths, b.sparse.lengths)
        np.testing.assert_array_equal(a.row_ids, b.row_ids)


def test_prepared_tsv_reads_back_as_the_raw_rows(synthetic_tsv: Path, tmp_path: Path) -> None:
    """Bad rows are dropped (and counted) when preparing; shuffled reads match row for row."""
    lines = (synthetic_tsv / "part-00000.tsv").read_text().splitlines(keepends=True)
    lines.insert(10, "1\t2\tbad\n")
    (tmp_path / "raw.tsv").write_text("".join(lines))
    raw = DataSource(format="criteo_tsv", paths=["raw.tsv"], on_error="skip")
    schema = criteo_schema()
    paths, summary = convert_to_parquet(
        raw, schema, tmp_path / "out", base_dir=tmp_path, row_group_rows=400, prepared=True
    )
    assert summary["rows"] == 1500 and summary["rows_skipped"] == 1
    file = pq.ParquetFile(paths[0])
    assert file.schema_arrow.metadata[PREPARED_KEY] == schema_fingerprint(schema).encode()
    assert str(file.schema_arrow.field("C1").type) == "int64"
    assert file.metadata.row_group(0).column(0).compression == "LZ4"
    prepared = DataSource(format="parquet", paths=["out/*.parquet"])
    converted = DataSource(format="parquet", paths=["plain/*.parquet"])
    convert_to_parquet(raw, schema, tmp_path / "plain", base_dir=tmp_path, row_group_rows=400)
    for options in ({}, {"shuffle_buffer": 700, "seed": 3}):
        expected = read(converted, schema, tmp_path, **options)
        assert_same_batches(read(prepared, schema, tmp_path, **options), expected)


def test_prepared_files_refuse_another_schema(synthetic_tsv: Path, tmp_path: Path) -> None:
    schema = criteo_schema()
    source = DataSource(format="criteo_tsv", paths=[str(synthetic_tsv / "part-00000.tsv")])
    convert_to_parquet(source, schema, tmp_path / "out", prepared=True)
    other = schema.model_copy(
        update={"dense": [DenseFeature(name=f.name, clip=(0.0, 10.0)) for f in schema.dense]}
    )
    with pytest.raises(ValueError, match=r"prepared for another schema .*`psrec data convert --prepared`"):
        read(DataSource(format="parquet", paths=[str(tmp_path / "out" / "*.parquet")]), other, tmp_path)


def test_parquet_converts_only_when_prepared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["data", "synth", str(tmp_path / "raw"), "--rows", "600", "--cardinality-scale", "0.001"]) == 0
    )
    (tmp_path / "criteo.yaml").write_text("schema:\n" + _criteo_schema_yaml())
    arguments = ["data", "convert", str(tmp_path / "raw" / "*.parquet"), "--format", "parquet"]
    arguments += ["--config", str(tmp_path / "criteo.yaml"), "--out", str(tmp_path / "out")]
    capsys.readouterr()
    assert main(arguments) == 2
    assert "--format parquet converts only with --prepared" in " ".join(capsys.readouterr().err.split())
    assert main([*arguments, "--prepared"]) == 0
    schema = criteo_schema()
    assert_same_batches(
        read(DataSource(format="parquet", paths=["out/*.parquet"]), schema, tmp_path),
        read(DataSource(format="parquet", paths=["raw/*.parquet"]), schema, tmp_path),
    )


def test_synthetic_data_can_be_read_prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSREC_CACHE", str(tmp_path / "cache"))
    sources = {}
    for prepared in (False, True):
        synthetic = {"train_rows": 700, "validation_rows": 100, "prepared": prepared}
        config = parse_config({"data": {"synthetic": synthetic}, "model": {"name": "dlrm"}}, source="<test>")
        sources[prepared] = prepare_data(config, base_dir=tmp_path)
    assert "-prepared-" in sources[True]["train"]["paths"][0]
    schema = criteo_schema()
    for split in ("train", "validation"):
        assert_same_batches(
            read(DataSource.model_validate(sources[True][split]), schema, tmp_path),
            read(DataSource.model_validate(sources[False][split]), schema, tmp_path),
        )


def _criteo_schema_yaml() -> str:
    import yaml

    dumped = yaml.safe_dump(criteo_schema().model_dump(mode="json"))
    return "".join("  " + line + "\n" for line in dumped.splitlines())


def test_prepared_multi_valued_features_read_back(tmp_path: Path) -> None:
    """libfm fields with several ids a row become list<int64> columns and read back the same."""
    (tmp_path / "a.libfm").write_bytes(b"1 0:1 12:1 30:1 31:1\n0 3:1 10:1\n1 4:1 11:1 33:1 34:1 35:1\n")
    schema = Schema.model_validate(
        {
            "label": "label",
            "sparse": [
                {"name": "user", "table": "users", "hashed": False},
                {"name": "item", "table": "items", "hashed": False},
                {"name": "tag", "table": "tags", "multi_valued": True},
            ],
        }
    )
    source = DataSource(
        format="libfm", paths=["a.libfm"], field_ranges={"user": (0, 9), "item": (10, 29), "tag": (30, 39)}
    )
    convert_to_parquet(source, schema, tmp_path / "out", base_dir=tmp_path, prepared=True)
    convert_to_parquet(source, schema, tmp_path / "plain", base_dir=tmp_path)
    prepared = read(DataSource(format="parquet", paths=["out/*.parquet"]), schema, tmp_path)
    assert_same_batches(
        prepared, read(DataSource(format="parquet", paths=["plain/*.parquet"]), schema, tmp_path)
    )
    assert prepared[0].sparse.lengths.tolist() == [1, 1, 1, 1, 1, 1, 2, 0, 3]
