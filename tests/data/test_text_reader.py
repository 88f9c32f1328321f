"""Criteo TSV / CSV reading: CRLF, gzip, blank and truncated lines, bad rows, byte-range units, resume."""

import gzip
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.data.errors import BadRowError
from psrec.data.lines import line_blocks
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SparseFeature
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.data.units import OFFSET_BITS, Unit, text_units

TSV = DataSource(format="criteo_tsv", paths=["*.tsv"], split_bytes=40_000)


def line_offsets(path: Path) -> list[int]:
    """Byte offsets of the non-blank lines (blank: nothing but a line end)."""
    offsets, position = [], 0
    for line in path.read_bytes().split(b"\n"):
        if line not in (b"", b"\r"):
            offsets.append(position)
        position += len(line) + 1
    return offsets


def expected_row_ids(directory: Path, pattern: str = "*.tsv") -> np.ndarray:
    files = sorted(directory.glob(pattern))
    return np.array([(i << OFFSET_BITS) + o for i, f in enumerate(files) for o in line_offsets(f)])


def read_batches(source: DataSource, schema: Schema, base_dir: Path, **options: object) -> list:
    with open_reader(source, schema, base_dir=base_dir, batch_size=100_000, **options) as reader:  # type: ignore[arg-type]
        return list(reader)


def assert_same_rows(first: list, second: list) -> None:
    a, b = first[0], second[0]
    assert a.batch_size == b.batch_size
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.sparse.ids, b.sparse.ids)
    np.testing.assert_array_equal(a.sparse.lengths, b.sparse.lengths)


def test_tsv_matches_parquet_of_the_same_rows(tmp_path: Path) -> None:
    write_synthetic_criteo(tmp_path, rows=1200, seed=9, format="tsv", cardinality_scale=0.001)
    write_synthetic_criteo(tmp_path, rows=1200, seed=9, format="parquet", cardinality_scale=0.001)
    tsv = read_batches(TSV, criteo_schema(), tmp_path)
    parquet = read_batches(DataSource(format="parquet", paths=["*.parquet"]), criteo_schema(), tmp_path)
    assert_same_rows(tsv, parquet)
    assert tsv[0].row_ids.tolist() == expected_row_ids(tmp_path).tolist()


def test_crlf_gzip_and_missing_final_line_end_read_the_same(synthetic_tsv: Path, tmp_path: Path) -> None:
    original = (synthetic_tsv / "part-00000.tsv").read_bytes()
    (tmp_path / "crlf.tsv").write_bytes(original.replace(b"\n", b"\r\n"))
    (tmp_path / "plain.tsv.gz").write_bytes(gzip.compress(original))
    (tmp_path / "no_final_newline.tsv").write_bytes(original.rstrip(b"\n"))
    (tmp_path / "blank_lines.tsv").write_bytes(original.replace(b"\n", b"\n\n", 3))
    reference = read_batches(
        TSV.model_copy(update={"paths": [str(synthetic_tsv / "part-00000.tsv")]}), criteo_schema(), tmp_path
    )
    for name in ("crlf.tsv", "plain.tsv.gz", "no_final_newline.tsv", "blank_lines.tsv"):
        batches = read_batches(TSV.model_copy(update={"paths": [name]}), criteo_schema(), tmp_path)
        assert_same_rows(batches, reference)
    gz = read_batches(TSV.model_copy(update={"paths": ["plain.tsv.gz"]}), criteo_schema(), tmp_path)
    assert gz[0].row_ids.tolist() == reference[0].row_ids.tolist()  # offsets of the uncompressed text


def test_csv_with_header_quotes_and_pass_through_ids(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('click,user,price,tags\r\n1,7,"2.5","x|y"\r\n0,8,,\r\n1,9,-4,z\r\n')
    schema = Schema(
        label="click",
        dense=[DenseFeature(name="price", fill=1.0, clip=(-1, 10))],
        sparse=[
            SparseFeature(name="user", table="users", hashed=False),
            SparseFeature(name="tags", table="tags", multi_valued=True),
        ],
    )
    (batch,) = read_batches(DataSource(format="csv", paths=["a.csv"]), schema, tmp_path)
    assert batch.labels.tolist() == [1, 0, 1]
    assert batch.dense[:, 0].tolist() == [2.5, 1.0, -1.0]
    assert batch.sparse.feature("user")[0].tolist() == [7, 8, 9]
    assert batch.sparse.feature("tags")[1].tolist() == [2, 0, 1]


def test_csv_schema_must_name_existing_columns(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("click,user\n1,7\n")
    schema = Schema(label="click", sparse=[SparseFeature(name="item", table="items")])
    with pytest.raises(ValueError, match=r"schema columns \['item'\] are not in"):
        read_batches(DataSource(format="csv", paths=["a.csv"]), schema, tmp_path)


def write_lines(path: Path, lines: list[str], end: str = "\n") -> None:
    path.write_text(end.join(lines) + end)


def criteo_line(label: str = "1", dense: str = "1", category: str = "ab12cd34") -> str:
    return "\t".join([label] + [dense] * 13 + [category] * 26)


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        (criteo_line().rsplit("\t", 1)[0], "expected 40 columns, got 39"),
        (criteo_line() + "\textra", "expected 40 columns, got 41"),
        (criteo_line(dense="3x"), "column I1: cannot parse '3x' as double"),
        (criteo_line(label=""), "missing label 'label'"),
    ],
)
def test_bad_rows_raise_with_file_line_and_text_or_are_skipped(
    tmp_path: Path, bad_line: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines = [criteo_line()] * 5 + [bad_line] + [criteo_line(dense="2")] * 3
    write_lines(tmp_path / "bad.tsv", lines, end="\r\n")
    source = TSV.model_copy(update={"paths": ["bad.tsv"]})
    with pytest.raises(BadRowError) as error:
        read_batches(source, criteo_schema(), tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'bad.tsv'}, line 6: {reason}")
    assert repr(bad_line)[1:40] in str(error.value)  # the offending text, as repr
    with (
        caplog.at_level(logging.WARNING),
        open_reader(
            source.model_copy(update={"on_error": "skip"}), criteo_schema(), batch_size=100, base_dir=tmp_path
        ) as reader,
    ):
        (batch,) = list(reader)
        stats = reader.stats()
    assert batch.batch_size == 8
    np.testing.assert_allclose(batch.dense[5:], np.log1p(2.0))  # rows after the bad one are not shifted
    assert stats["rows_skipped"] == 1 and stats["skipped_samples"][0]["location"] == "line 6"
    assert stats["skipped_samples"][0]["reason"] == reason
    assert "skipping bad row" in caplog.text


def test_truncated_last_line(tmp_path: Path) -> None:
    write_synthetic_criteo(tmp_path, rows=50, seed=4, format="tsv", cardinality_scale=0.001)
    data = (tmp_path / "part-00000.tsv").read_bytes()
    (tmp_path / "part-00000.tsv").write_bytes(data[: len(data) - 40])
    with pytest.raises(BadRowError, match=r"part-00000.tsv, line 50: expected 40 columns"):
        read_batches(TSV, criteo_schema(), tmp_path)
    (batch,) = read_batches(TSV.model_copy(update={"on_error": "skip"}), criteo_schema(), tmp_path)
    assert batch.batch_size == 49


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.tsv.gz").write_bytes(gzip.compress(criteo_line().encode() * 50)[:-30] + b"garbage")
    source = TSV.model_copy(update={"paths": ["broken.tsv.gz"]})
    with pytest.raises(BadRowError, match="broken.tsv.gz, line 1: (corrupt gzip data|the gzip stream ends)"):
        read_batches(source, criteo_schema(), tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        read_batches(source.model_copy(update={"paths": ["missing.tsv"]}), criteo_schema(), tmp_path)


@pytest.mark.parametrize("shuffle_buffer", [0, 450])
def test_sharded_resume_is_exactly_once(
    harness: SimpleNamespace, synthetic_tsv: Path, shuffle_buffer: int
) -> None:
    harness.check_sharded_resume(
        TSV, criteo_schema(), synthetic_tsv, expected_row_ids(synthetic_tsv),
        seed=shuffle_buffer + 1, batch_size=170, shuffle_buffer=shuffle_buffer,
    )  # fmt: skip


def test_gzip_sharded_resume(harness: SimpleNamespace, synthetic_tsv: Path, tmp_path: Path) -> None:
    for path in sorted(synthetic_tsv.glob("*.tsv")):
        (tmp_path / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
    head = (synthetic_tsv / "part-00000.tsv").read_bytes()
    head = head[: head.rindex(b"\n", 0, 30000) + 1]  # a third, smaller file of whole lines
    (tmp_path / "part-00002.tsv.gz").write_bytes(gzip.compress(head))
    source = TSV.model_copy(update={"paths": ["*.tsv.gz"]})
    expected = np.concatenate(
        [
            expected_row_ids(synthetic_tsv),
            [(2 << OFFSET_BITS) + o for o in line_offsets(synthetic_tsv / "part-00000.tsv") if o < len(head)],
        ]
    )
    harness.check_sharded_resume(
        source, criteo_schema(), tmp_path, expected, seed=5, batch_size=333, shuffle_buffer=400
    )


@settings(max_examples=25, deadline=None)
@given(
    lines=st.lists(st.text(alphabet="ab\r", min_size=0, max_size=6), min_size=1, max_size=12),
    split=st.integers(1, 20),
    final_newline=st.booleans(),
)
def test_byte_ranges_own_each_line_once(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], split: int, final_newline: bool
) -> None:
    path = tmp_path_factory.mktemp("lines") / "f.txt"
    text = "\n".join(lines) + ("\n" if final_newline else "")
    path.write_bytes(text.encode())
    seen = []
    for unit in text_units(0, path, split):
        for block in line_blocks(unit, block_bytes=7):
            seen.extend((block.offset + block.starts).tolist())
    assert seen == line_offsets(path)
    first = seen[0] if seen else None
    if first is not None:  # resuming after a line gives the lines after it
        after = [
            block.offset + s
            for block in line_blocks(Unit(0, str(path), 0, len(text)), after=first)
            for s in block.starts
        ]
        assert after == seen[1:]


def test_header_line_is_skipped_only_at_the_start(tmp_path: Path) -> None:
    rows = pa.table({"y": [1, 0] * 200, "a": [f"v{i}" for i in range(400)]})
    pa_csv.write_csv(rows, tmp_path / "h.csv")
    schema = Schema(label="y", sparse=[SparseFeature(name="a", table="a")])
    source = DataSource(format="csv", paths=["h.csv"], split_bytes=500)
    batches = read_batches(source, schema, tmp_path)
    assert batches[0].batch_size == 400
    assert (
        batches[0].sparse.ids.tolist()
        == read_batches(source.model_copy(update={"split_bytes": 1 << 20}), schema, tmp_path)[
            0
        ].sparse.ids.tolist()
    )


def test_skipped_rows_are_numbered_in_gzip_files(tmp_path: Path) -> None:
    lines = [criteo_line()] * 300
    for number in (3, 50, 299):
        lines[number - 1] = criteo_line(dense="oops")
    (tmp_path / "bad.tsv.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    source = TSV.model_copy(update={"paths": ["bad.tsv.gz"], "on_error": "skip"})
    with open_reader(source, criteo_schema(), batch_size=1000, base_dir=tmp_path) as reader:
        assert sum(batch.batch_size for batch in reader) == 297
        stats = reader.stats()
    assert [sample["location"] for sample in stats["skipped_samples"]] == ["line 3", "line 50", "line 299"]
    assert all(
        sample["reason"] == "column I1: cannot parse 'oops' as double" for sample in stats["skipped_samples"]
    )
