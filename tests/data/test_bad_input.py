"""Bad text input: damaged files keep the rows before the damage and are counted apart from skipped
rows; labels must be 0 or 1; dense values that are not finite float32 numbers are filled (counted),
skipped or refused; empty files are errors unless allowed. See docs/fault_tolerance.md, "Bad input"."""

from __future__ import annotations

import gzip
import logging
import os
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.data.errors import BadRowError
from psrec.data.lines import line_spans
from psrec.data.reader import PreparedCache, open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SparseFeature
from psrec.data.synth import criteo_schema

TSV = DataSource(format="criteo_tsv", paths=["*.tsv*"])
FIELDS = {"user": (0, 9), "item": (10, 29)}
LIBFM_SCHEMA = Schema(
    label="label",
    sparse=[
        SparseFeature(name="user", table="users", hashed=False),
        SparseFeature(name="item", table="items", hashed=False),
    ],
)


def criteo_line(rng: random.Random, label: str = "1", dense: str | None = None) -> str:
    values = [dense if dense is not None else str(rng.randint(0, 999)) for _ in range(13)]
    return "\t".join([label, *values, *(f"{rng.getrandbits(32):08x}" for _ in range(26))])


def criteo_text(rows: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return "".join(criteo_line(rng) + "\n" for _ in range(rows)).encode()


def read(
    source: DataSource, schema: Schema, base_dir: Path, **options: Any
) -> tuple[list[Any], dict[str, Any]]:
    with open_reader(source, schema, batch_size=1 << 20, base_dir=base_dir, **options) as reader:
        batches = list(reader)
        return batches, reader.stats()


def rows_of(batches: list[Any]) -> int:
    return sum(batch.batch_size for batch in batches)


def decodable_prefix(compressed: bytes) -> bytes:
    """What zlib decodes of a damaged gzip stream before the damage, fed one byte at a time."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = []
    for index in range(len(compressed)):
        try:
            out.append(inflate.decompress(compressed[index : index + 1]))
        except zlib.error:
            break
    return b"".join(out)


# --- damaged files (a unit not read to its end) ---------------------------------------------------


def test_a_gzip_cut_short_keeps_the_rows_before_the_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = criteo_text(400)
    compressed = gzip.compress(text)
    cut = compressed[: len(compressed) * 3 // 5]
    (tmp_path / "day.tsv.gz").write_bytes(cut)
    prefix = decodable_prefix(cut)
    whole_lines = prefix.count(b"\n")
    assert 0 < whole_lines < 400 and not prefix.endswith(b"\n")
    skip = TSV.model_copy(update={"on_error": "skip"})
    with caplog.at_level(logging.WARNING):
        batches, stats = read(skip, criteo_schema(), tmp_path)
    assert rows_of(batches) == whole_lines  # every whole line before the cut
    assert stats["rows_skipped"] == 1  # the line the cut ends inside
    sample = stats["skipped_samples"][0]
    assert sample["location"] == f"line {whole_lines + 1}" and "cut short" in sample["reason"]
    assert text.decode().splitlines()[whole_lines].startswith(sample["text"])
    assert stats["units_failed"] == 1 and stats["bytes_lost"] == 0  # what is missing is unknown
    (failed,) = stats["failed_units"]
    assert failed["file"] == str(tmp_path / "day.tsv.gz") and "cut short" in failed["reason"]
    assert "could not read all of" in caplog.text and "day.tsv.gz" in caplog.text
    with pytest.raises(BadRowError, match=rf"day.tsv.gz, line {whole_lines + 1}: the gzip stream ends"):
        read(TSV, criteo_schema(), tmp_path)


def test_a_gzip_cut_at_a_line_end_loses_no_row_but_fails_the_unit(tmp_path: Path) -> None:
    text = criteo_text(50)
    inflate = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    (tmp_path / "day.tsv.gz").write_bytes(inflate.compress(text) + inflate.flush(zlib.Z_SYNC_FLUSH))
    batches, stats = read(TSV.model_copy(update={"on_error": "skip"}), criteo_schema(), tmp_path)
    assert rows_of(batches) == 50 and stats["rows_skipped"] == 0
    assert stats["units_failed"] == 1
    with pytest.raises(BadRowError, match=r"day.tsv.gz, file: the gzip stream ends before its end marker"):
        read(TSV, criteo_schema(), tmp_path)


def test_a_corrupt_gzip_keeps_what_decodes_and_counts_the_bytes_lost(tmp_path: Path) -> None:
    text = criteo_text(3000, seed=1)
    compressed = bytearray(gzip.compress(text))
    middle = len(compressed) // 2
    compressed[middle : middle + 64] = b"\xff" * 64
    (tmp_path / "day.tsv.gz").write_bytes(bytes(compressed))
    prefix = decodable_prefix(bytes(compressed))
    intact = os.path.commonprefix([prefix, text]).count(b"\n")  # whole lines before the damage
    batches, stats = read(TSV.model_copy(update={"on_error": "skip"}), criteo_schema(), tmp_path)
    assert rows_of(batches) == intact > 1000
    assert (
        rows_of(batches) + stats["rows_skipped"] == line_spans(prefix)[0].size
    )  # the rest decoded: bad rows
    assert stats["units_failed"] == 1 and "corrupt gzip data" in stats["failed_units"][0]["reason"]
    assert 0 < stats["bytes_lost"] <= len(compressed) - middle


def test_a_cut_last_token_in_a_gzip_that_ended_early_is_a_bad_row(tmp_path: Path) -> None:
    """A last line without a line end is read when its file ends properly; when the gzip stream ended
    early it is cut short (here its last hex token is 'c8f8e', missing 3 digits)."""
    rng = random.Random(3)
    lines = [criteo_line(rng) for _ in range(20)]
    last = lines[-1].rsplit("\t", 1)[0] + "\tc8f8e"
    whole = gzip.compress(("\n".join(lines[:-1]) + "\n" + lines[-1]).encode())
    (tmp_path / "complete.tsv.gz").write_bytes(whole)  # no final line end, but a complete stream
    batches, stats = read(TSV.model_copy(update={"paths": ["complete.tsv.gz"]}), criteo_schema(), tmp_path)
    assert rows_of(batches) == 20 and stats["units_failed"] == 0
    inflate = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    body = ("\n".join(lines[:-1]) + "\n" + last).encode()
    (tmp_path / "cut.tsv.gz").write_bytes(inflate.compress(body) + inflate.flush(zlib.Z_SYNC_FLUSH))
    cut = TSV.model_copy(update={"paths": ["cut.tsv.gz"]})
    with pytest.raises(BadRowError, match=r"cut.tsv.gz, line 20: the gzip stream ends") as error:
        read(cut, criteo_schema(), tmp_path)
    assert error.value.text == last
    batches, stats = read(cut.model_copy(update={"on_error": "skip"}), criteo_schema(), tmp_path)
    assert rows_of(batches) == 19 and stats["rows_skipped"] == 1 and stats["units_failed"] == 1


def test_an_unreadable_libfm_file_keeps_its_earlier_lines(tmp_path: Path) -> None:
    text = "".join(f"{i % 2} {i % 10}:1 {10 + i % 20}:1\n" for i in range(2000)).encode()
    compressed = gzip.compress(text)
    (tmp_path / "a.libfm").write_bytes(compressed[: len(compressed) // 2])
    prefix = decodable_prefix(compressed[: len(compressed) // 2])
    source = DataSource(format="libfm", paths=["a.libfm"], field_ranges=FIELDS, on_error="skip")
    batches, stats = read(source, LIBFM_SCHEMA, tmp_path)
    assert rows_of(batches) == prefix.count(b"\n") > 0
    assert stats["units_failed"] == 1 and stats["rows_skipped"] == (0 if prefix.endswith(b"\n") else 1)


def test_a_cached_epoch_counts_what_the_first_read_counted(tmp_path: Path) -> None:
    compressed = gzip.compress(criteo_text(100) + b"1\tbad\n" + criteo_text(300, seed=4))
    (tmp_path / "day.tsv.gz").write_bytes(compressed[: len(compressed) * 4 // 5])
    skip = TSV.model_copy(update={"on_error": "skip"})
    cache = PreparedCache()
    first_batches, first = read(skip, criteo_schema(), tmp_path, cache=cache)
    assert len(cache) == 1
    second_batches, second = read(skip, criteo_schema(), tmp_path, cache=cache)
    assert rows_of(first_batches) == rows_of(second_batches)
    for key in ("rows_skipped", "units_failed", "bytes_lost", "failed_units", "skipped_samples"):
        assert second[key] == first[key], key
    assert first["rows_skipped"] == 2 and first["units_failed"] == 1


# --- labels ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "shown"), [("nan", "nan"), ("2", "2"), ("-1", "-1"), ("0.5", "0.5")])
@pytest.mark.parametrize("file_format", ["criteo_tsv", "csv"])
def test_text_labels_must_be_0_or_1(tmp_path: Path, file_format: str, label: str, shown: str) -> None:
    rng = random.Random(5)
    lines = [criteo_line(rng, label=str(i % 2)) for i in range(6)]
    lines[3] = criteo_line(rng, label=label)
    separator = "\t" if file_format == "criteo_tsv" else ","
    body = "\n".join(line.replace("\t", separator) for line in lines) + "\n"
    header = ",".join(criteo_schema().label_names + criteo_schema().feature_names) + "\n"
    (tmp_path / "a.txt").write_text(header + body if file_format == "csv" else body)
    source = DataSource(format=file_format, paths=["a.txt"])  # type: ignore[arg-type]
    line = 5 if file_format == "csv" else 4
    with pytest.raises(BadRowError, match=rf"a.txt, line {line}: label 'label' is {shown}: expected 0 or 1"):
        read(source, criteo_schema(), tmp_path)
    batches, stats = read(source.model_copy(update={"on_error": "skip"}), criteo_schema(), tmp_path)
    assert stats["rows_skipped"] == 1 and stats["skipped_samples"][0]["location"] == f"line {line}"
    assert batches[0].labels.tolist() == [0, 1, 0, 0, 1]


@pytest.mark.parametrize("label", ["3", "0.5", "2", "-2", "1e-999", "11"])
def test_libfm_labels_must_be_1_0_or_minus_1(tmp_path: Path, label: str) -> None:
    good = [
        "1 3:1 12:1",
        "-1 4:1 10:1",
        "0 5:1 11:1",
        "1.0 6:1 13:1",
        "+1 7:1 14:1",
        "10e-1 8:1 15:1",
        "-0 9:1 16:1",
    ]
    (tmp_path / "a.libfm").write_text("\n".join([*good, f"{label} 1:1 17:1"]) + "\n")
    source = DataSource(format="libfm", paths=["a.libfm"], field_ranges=FIELDS)
    with pytest.raises(BadRowError, match=rf"a.libfm, line 8: label is not 1, 0 or -1.*\({label!r}\)"):
        read(source, LIBFM_SCHEMA, tmp_path)
    batches, stats = read(source.model_copy(update={"on_error": "skip"}), LIBFM_SCHEMA, tmp_path)
    assert stats["rows_skipped"] == 1
    assert batches[0].labels.tolist() == [1, 0, 0, 1, 1, 1, 0]


# --- dense values ------------------------------------------------------------------------------


def dense_file(tmp_path: Path, values: list[str]) -> Path:
    rng = random.Random(6)
    lines = [criteo_line(rng, dense="1") for _ in values]
    lines = [
        line.split("\t", 2)[0] + "\t" + value + "\t" + line.split("\t", 2)[2]
        for line, value in zip(lines, values, strict=True)
    ]
    path = tmp_path / "dense.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def schema_with_i1(**options: Any) -> Schema:
    schema = criteo_schema()
    dense = [DenseFeature(name="I1", **options), *schema.dense[1:]]
    return schema.model_copy(update={"dense": dense})


def test_dense_values_that_are_not_finite_float32_are_filled_clipped_and_counted(tmp_path: Path) -> None:
    dense_file(tmp_path, ["5", "nan", "inf", "1e39", "-1e300", "", "7"])
    source = TSV.model_copy(update={"paths": ["dense.tsv"]})
    (batch,), stats = read(source, schema_with_i1(fill=-3.0), tmp_path)
    assert np.isfinite(batch.dense).all()
    limit = np.finfo(np.float32).max
    assert batch.dense[:, 0].tolist() == [5, -3, -3, limit, -limit, -3, 7]
    assert (stats["dense_values_missing"], stats["dense_values_filled"], stats["dense_values_clipped"]) == (
        1,
        2,
        2,
    )
    assert stats["dense_values"]["I1"] == {"missing": 1, "filled": 2, "clipped": 2}
    assert stats["rows_skipped"] == 0
    (batch,), _ = read(source, criteo_schema(), tmp_path)  # Criteo's log1p
    assert np.isfinite(batch.dense).all()


def test_dense_invalid_skip_and_raise(tmp_path: Path) -> None:
    dense_file(tmp_path, ["5", "nan", "", "1e39", "7"])
    source = TSV.model_copy(update={"paths": ["dense.tsv"]})
    (batch,), stats = read(source, schema_with_i1(invalid="skip"), tmp_path)  # skips under on_error raise
    assert batch.dense[:, 0].tolist() == [5, 0, 7] and stats["rows_skipped"] == 2
    assert [s["location"] for s in stats["skipped_samples"]] == ["line 2", "line 4"]
    assert "dense feature 'I1' is nan" in stats["skipped_samples"][0]["reason"]
    skip = source.model_copy(update={"on_error": "skip"})
    with pytest.raises(BadRowError, match=r"dense.tsv, line 2: dense feature 'I1' is nan, not a finite"):
        read(skip, schema_with_i1(invalid="raise"), tmp_path)  # raises under on_error skip


def test_a_non_finite_fill_is_refused() -> None:
    with pytest.raises(ValueError, match="fill must be a finite float32"):
        DenseFeature(name="x", fill=float("nan"))
    with pytest.raises(ValueError, match="fill must be a finite float32"):
        DenseFeature(name="x", fill=1e39)


def test_cached_epochs_count_filled_values_again(tmp_path: Path) -> None:
    dense_file(tmp_path, ["5", "nan", "inf", "1e39"])
    source = TSV.model_copy(update={"paths": ["dense.tsv"]})
    cache = PreparedCache()
    _, first = read(source, schema_with_i1(), tmp_path, cache=cache)
    _, second = read(source, schema_with_i1(), tmp_path, cache=cache)
    assert (
        second["dense_values"] == first["dense_values"] == {"I1": {"missing": 0, "filled": 2, "clipped": 1}}
    )


# --- empty files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "options"),
    [
        ("empty.tsv", b"", {}),
        ("blank.tsv", b"\n\r\n\n", {}),
        ("empty.tsv.gz", gzip.compress(b""), {}),
        ("header.csv", b"label,I1\r\n", {"format": "csv"}),
        ("empty.libfm", b"\n", {"format": "libfm", "field_ranges": FIELDS}),
        ("empty.txt", b"", {"format": "interactions"}),
    ],
)
def test_an_empty_file_is_an_error_unless_allowed(
    tmp_path: Path, name: str, content: bytes, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / name).write_bytes(content)
    schema = {
        "csv": Schema(label="label", dense=[DenseFeature(name="I1")]),
        "libfm": LIBFM_SCHEMA,
        "interactions": None,
    }.get(options.get("format", ""), criteo_schema())
    if schema is None:
        from psrec.data.sequences import sasrec_schema

        schema = sasrec_schema(max_length=5)
    source = DataSource.model_validate({"format": "criteo_tsv", "paths": [name], **options})
    with pytest.raises(BadRowError, match=rf"{name}, file: the file has .*set allow_empty: true"):
        read(source, schema, tmp_path)
    with pytest.raises(BadRowError, match="allow_empty"):  # on_error skip does not make it a bad row
        read(source.model_copy(update={"on_error": "skip"}), schema, tmp_path)
    with caplog.at_level(logging.WARNING):
        batches, stats = read(source.model_copy(update={"allow_empty": True}), schema, tmp_path)
    assert rows_of(batches) == 0 and f"{name} has" in caplog.text


def test_concatenated_gzip_members_and_zero_padding_read_as_one_file(tmp_path: Path) -> None:
    """`GzipStream` decodes every member of a gzip file (as `cat a.gz b.gz` makes), as gzip does."""
    first, second = criteo_text(30, seed=7), criteo_text(20, seed=8)
    (tmp_path / "day.tsv.gz").write_bytes(gzip.compress(first) + gzip.compress(second) + bytes(16))
    batches, stats = read(TSV, criteo_schema(), tmp_path)
    assert rows_of(batches) == 50 and stats["units_failed"] == 0
