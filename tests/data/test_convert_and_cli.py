"""`psrec data convert` / `synth`: Parquet output reads back identically; the real samples (if present)."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from psrec.cli import main
from psrec.data.convert import convert_to_parquet
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, Schema, SparseFeature
from psrec.data.synth import criteo_schema

AVAZU_CATEGORICAL = [
    "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
    "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
    "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]  # fmt: skip


def one_batch(source: DataSource, schema: Schema, base_dir: Path):  # noqa: ANN201
    with open_reader(source, schema, batch_size=1 << 20, base_dir=base_dir) as reader:
        batches = list(reader)
        assert len(batches) == 1
        return batches[0], reader.stats()


def test_convert_tsv_reads_back_identically(synthetic_tsv: Path, tmp_path: Path) -> None:
    lines = (synthetic_tsv / "part-00000.tsv").read_text().splitlines(keepends=True)
    lines.insert(10, "1\t2\tbad\n")
    (tmp_path / "raw.tsv").write_text("".join(lines))
    raw = DataSource(format="criteo_tsv", paths=["raw.tsv"], on_error="skip")
    paths, summary = convert_to_parquet(
        raw, criteo_schema(), tmp_path / "out", base_dir=tmp_path, row_group_rows=400
    )
    assert [p.name for p in paths] == ["raw.parquet"]
    assert pq.ParquetFile(paths[0]).metadata.num_row_groups == 4
    assert summary["rows"] == 1500 and summary["rows_skipped"] == 1
    assert summary["skipped_samples"][0]["location"] == "line 11"
    expected, _ = one_batch(raw, criteo_schema(), tmp_path)
    converted, _ = one_batch(DataSource(format="parquet", paths=["out/*.parquet"]), criteo_schema(), tmp_path)
    np.testing.assert_array_equal(expected.labels, converted.labels)
    np.testing.assert_array_equal(expected.dense, converted.dense)
    np.testing.assert_array_equal(expected.sparse.ids, converted.sparse.ids)


def test_cli_synth_and_convert_libfm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "data",
                "synth",
                str(tmp_path / "synth"),
                "--rows",
                "300",
                "--files",
                "2",
                "--cardinality-scale",
                "0.001",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "synth").iterdir()) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    (tmp_path / "a.libfm").write_bytes(b"1 0:1 12:1 30:1 31:1\r\n-1 3:1 10:1\r\n")
    config = {
        "schema": {
            "label": "label",
            "sparse": [
                {"name": "user", "table": "users", "hashed": False},
                {"name": "item", "table": "items", "hashed": False},
                {"name": "tag", "table": "tags", "multi_valued": True},
            ],
        },
        "source": {"field_ranges": {"user": [0, 9], "item": [10, 29], "tag": [30, 39]}},
    }
    (tmp_path / "frappe.yaml").write_text(yaml.safe_dump(config))
    arguments = [
        "data",
        "convert",
        str(tmp_path / "a.libfm"),
        "--format",
        "libfm",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main([*arguments, "--config", str(tmp_path / "frappe.yaml")]) == 0
    schema = Schema.model_validate(config["schema"])
    source = DataSource(format="libfm", paths=["a.libfm"], field_ranges=config["source"]["field_ranges"])
    expected, _ = one_batch(source, schema, tmp_path)
    converted, _ = one_batch(DataSource(format="parquet", paths=["out/a.parquet"]), schema, tmp_path)
    np.testing.assert_array_equal(expected.sparse.ids, converted.sparse.ids)
    np.testing.assert_array_equal(expected.sparse.lengths, converted.sparse.lengths)
    assert converted.labels.tolist() == [1.0, 0.0]
    capsys.readouterr()
    assert main(arguments) == 2  # libfm needs field ranges
    assert "format 'libfm' needs field_ranges: {field: [first_id, last_id]" in capsys.readouterr().err
    config["source"]["field_ranges"]["tag"] = [5, 39]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    assert main([*arguments, "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "overlap" in capsys.readouterr().err


def test_real_criteo_and_avazu_samples(shared_data: Path) -> None:
    samples = shared_data / "samples"
    if not (samples / "criteo_sample.txt").is_file():
        pytest.skip("samples not available")
    criteo = DataSource(format="csv", paths=[str(samples / "criteo_sample.txt")])
    batch, stats = one_batch(criteo, criteo_schema(), samples)
    assert batch.batch_size == 200 and stats["rows_skipped"] == 0
    assert np.isfinite(batch.dense).all() and batch.dense.min() >= 0  # log1p of max(x, 0)
    avazu_schema = Schema(label="click", sparse=[SparseFeature(name=n, table=n) for n in AVAZU_CATEGORICAL])
    avazu = DataSource(format="csv", paths=[str(samples / "avazu_sample.txt")])
    batch, _ = one_batch(avazu, avazu_schema, samples)
    assert batch.batch_size == 100 and set(np.unique(batch.labels).tolist()) <= {0.0, 1.0}


def test_convert_refuses_an_output_directory_that_holds_an_input(
    synthetic_parquet: Path, tmp_path: Path
) -> None:
    """Converting a Parquet file into its own directory (with --prepared) used to overwrite the input
    with the first row group's rows; now it is refused and the input is untouched."""
    data = tmp_path / "data"
    data.mkdir()
    source_file = data / "part-00000.parquet"
    source_file.write_bytes((synthetic_parquet / "part-00000.parquet").read_bytes())
    before = source_file.read_bytes()
    source = DataSource(format="parquet", paths=[str(source_file)])
    for out in (data, tmp_path):  # the input's directory, and a directory above it
        with pytest.raises(ValueError, match="holds the input file"):
            convert_to_parquet(source, criteo_schema(), out, prepared=True, row_group_rows=1000)
    assert source_file.read_bytes() == before
    assert sorted(p.name for p in data.iterdir()) == ["part-00000.parquet"]
    config = tmp_path / "schema.yaml"
    config.write_text(yaml.safe_dump({"schema": criteo_schema().model_dump(mode="json")}))
    options = ["--format", "parquet", "--prepared", "--config", str(config), "--out", str(data)]
    code = main(["data", "convert", str(source_file), *options])
    assert code == 1 and source_file.read_bytes() == before


def test_a_failed_conversion_leaves_no_partial_output(synthetic_tsv: Path, tmp_path: Path) -> None:
    """Output files appear only when every file converted: a bad row in the second file (on_error:
    raise) leaves neither the first file's output nor temporary files, and an older output file of
    the same name is kept as it was."""
    good = (synthetic_tsv / "part-00000.tsv").read_text()
    (tmp_path / "a.tsv").write_text(good)
    (tmp_path / "b.tsv").write_text(good + "1\t2\tbad\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.parquet").write_bytes(b"an older conversion")
    source = DataSource(format="criteo_tsv", paths=["a.tsv", "b.tsv"], on_error="raise")
    with pytest.raises(Exception, match="line"):
        convert_to_parquet(source, criteo_schema(), out, base_dir=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["a.parquet"]
    assert (out / "a.parquet").read_bytes() == b"an older conversion"
    paths, summary = convert_to_parquet(
        DataSource(format="criteo_tsv", paths=["a.tsv"]), criteo_schema(), out, base_dir=tmp_path
    )
    assert [p.name for p in out.iterdir()] == ["a.parquet"] and summary["rows"] == pq.ParquetFile(
        paths[0]
    ).metadata.num_rows
