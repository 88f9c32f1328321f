"""Fuzz of every text reader (criteo_tsv, csv, libfm, interactions): valid rows with random bytes,
tabs, commas, CR/CRLF, line ends and quotes inserted, ranges deleted, the text or its gzip stream cut.

What must hold for any input: under `on_error: raise` the reader either reads it or raises its named
`BadRowError`; under `skip` it never raises; every row it delivers is the reference parse of the
line its row id points at (no shifted column, no row from two lines); and the rows skipped are
exactly the non-blank lines it did not deliver.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import math
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrec.data.errors import BadRowError, BadRows
from psrec.data.feature_hashing import hash_values
from psrec.data.libfm_format import parse_line_reference
from psrec.data.lines import line_spans
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SparseFeature
from psrec.data.sequences import load_interactions
from psrec.data.units import OFFSET_MASK, is_gzip

COLUMNS = ["label", "d", "id", "tag"]
DELIMITED_SCHEMA = Schema(
    label="label",
    dense=[DenseFeature(name="d", fill=-7.0)],
    sparse=[SparseFeature(name="id", table="ids", hashed=False), SparseFeature(name="tag", table="tags")],
)
FIELDS = {"user": (0, 9), "item": (10, 29), "tag": (30, 39)}
LIBFM_SCHEMA = Schema(
    label="label",
    sparse=[
        SparseFeature(name="user", table="users", hashed=False),
        SparseFeature(name="item", table="items", hashed=False),
        SparseFeature(name="tag", table="tags", hashed=False, multi_valued=True),
    ],
)
FLOAT32_MAX = float(np.finfo(np.float32).max)

MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "delete", "truncate"]),
        st.integers(0, 1 << 16),
        st.one_of(
            st.binary(min_size=1, max_size=3),
            st.sampled_from([b"\t", b",", b"\r\n", b"\r", b"\n", b'"', b'""', b":", b" "]),
        ),
    ),
    max_size=4,
)
DAMAGE = st.one_of(st.none(), st.just("gzip"), st.tuples(st.just("gzip_cut"), st.floats(0, 1)))
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mutate(text: bytes, mutations: list[tuple[str, int, bytes]]) -> bytes:
    for kind, where, payload in mutations:
        position = where % (len(text) + 1)
        if kind == "insert":
            text = text[:position] + payload + text[position:]
        elif kind == "delete":
            text = text[:position] + text[position + len(payload) :]
        else:
            text = text[:position]
    return text


def store(path: Path, text: bytes, damage: Any) -> None:
    if damage is None:
        path.write_bytes(text)
        return
    compressed = gzip.compress(text)
    if damage != "gzip":
        compressed = compressed[: int(len(compressed) * damage[1])]
    path.write_bytes(compressed)


def decoded(path: Path) -> bytes:
    """The text the reader sees: the file, or what zlib decodes of its gzip stream before any damage."""
    data = path.read_bytes()
    if not is_gzip(path):
        return data
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = []
    for index in range(len(data)):
        try:
            out.append(inflate.decompress(data[index : index + 1]))
        except zlib.error:
            break
        if inflate.eof:
            break
    return b"".join(out)


def lines_by_offset(text: bytes) -> dict[int, bytes]:
    starts, ends = line_spans(text)
    return {int(s): text[int(s) : int(e)] for s, e in zip(starts, ends, strict=True)}


def read_both(source: DataSource, schema: Schema, base_dir: Path) -> tuple[list[Any], dict[str, Any]]:
    try:  # raise: read it all, or raise the reader's named error
        with open_reader(source, schema, batch_size=7, base_dir=base_dir, prefetch=0) as reader:
            list(reader)
    except BadRowError:
        pass
    skip = source.model_copy(update={"on_error": "skip"})
    with open_reader(skip, schema, batch_size=7, base_dir=base_dir, prefetch=0) as reader:
        return list(reader), reader.stats()


def check_counts(lines: dict[int, bytes], batches: list[Any], stats: dict[str, Any]) -> list[int]:
    offsets = [int(r) & OFFSET_MASK for batch in batches for r in batch.row_ids]
    assert len(set(offsets)) == len(offsets), "a line delivered twice"
    assert set(offsets) <= set(lines), "a row that starts no line"
    assert stats["rows_skipped"] == len(lines) - len(offsets), "skipped rows miscounted"
    return offsets


def dense_reference(text: str) -> float:
    if text == "":
        return -7.0
    value = float(text)
    if not math.isfinite(value):
        return -7.0
    return float(np.float32(max(-FLOAT32_MAX, min(FLOAT32_MAX, value))))


def delimited_rows(draw_rows: list[tuple[int, int | None, int, str]], delimiter: str) -> bytes:
    return "".join(
        delimiter.join([str(label), "" if dense is None else str(dense), str(ident), tag]) + "\n"
        for label, dense, ident, tag in draw_rows
    ).encode()


ROWS = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.one_of(st.none(), st.integers(-5, 99)),
        st.integers(0, 999),
        st.text("abc", max_size=3),
    ),
    max_size=12,
)


@FUZZ
@given(
    rows=ROWS,
    mutations=MUTATIONS,
    damage=DAMAGE,
    file_format=st.sampled_from(["criteo_tsv", "csv"]),
    split=st.integers(8, 400),
)
def test_delimited_readers_survive_fuzzed_input(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[tuple[int, int | None, int, str]],
    mutations: list[tuple[str, int, bytes]],
    damage: Any,
    file_format: str,
    split: int,
) -> None:
    directory = tmp_path_factory.mktemp("fuzz")
    delimiter = "\t" if file_format == "criteo_tsv" else ","
    store(directory / "f", mutate(delimited_rows(rows, delimiter), mutations), damage)
    source = DataSource(
        format=file_format,  # type: ignore[arg-type]
        paths=["f"],
        columns=COLUMNS,
        header=False,
        split_bytes=split,
        allow_empty=True,
    )
    batches, stats = read_both(source, DELIMITED_SCHEMA, directory)
    lines = lines_by_offset(decoded(directory / "f"))
    check_counts(lines, batches, stats)
    for batch in batches:
        ids, _ = batch.sparse.feature("id")
        tags, _ = batch.sparse.feature("tag")
        for index, row_id in enumerate(batch.row_ids):
            line = lines[int(row_id) & OFFSET_MASK].decode("utf-8")
            if file_format == "csv":
                (fields,) = list(csv.reader([line], delimiter=","))
            else:
                fields = line.split("\t")
            assert len(fields) == 4, line
            label, dense, ident, tag = fields
            assert batch.labels[index] == float(label) and float(label) in (0.0, 1.0), line
            assert batch.dense[index, 0] == dense_reference(dense), line
            assert ids[index] == int(ident), line
            assert tags[index] == hash_values("tag", pa.array([tag]))[0], line


LIBFM_ROWS = st.lists(
    st.tuples(
        st.sampled_from(["1", "0", "-1"]),
        st.integers(0, 9),
        st.integers(10, 29),
        st.lists(st.integers(30, 39), max_size=2),
    ),
    max_size=10,
)


def libfm_line_is_good(line: bytes) -> bool:
    parsed = parse_line_reference(line.decode("utf-8", errors="replace"))
    if isinstance(parsed, str):
        return False
    ids = parsed[1]
    users = [i for i in ids if i <= 9]
    items = [i for i in ids if 10 <= i <= 29]
    return len(users) == 1 and len(items) == 1 and all(i <= 39 for i in ids)


@FUZZ
@given(rows=LIBFM_ROWS, mutations=MUTATIONS, damage=DAMAGE, split=st.integers(8, 300))
def test_libfm_reader_survives_fuzzed_input(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[tuple[str, int, int, list[int]]],
    mutations: list[tuple[str, int, bytes]],
    damage: Any,
    split: int,
) -> None:
    directory = tmp_path_factory.mktemp("fuzz")
    text = "".join(
        " ".join([label, f"{user}:1", f"{item}:1.0", *(f"{tag}:1" for tag in tags)]) + "\n"
        for label, user, item, tags in rows
    ).encode()
    store(directory / "f", mutate(text, mutations), damage)
    source = DataSource(format="libfm", paths=["f"], field_ranges=FIELDS, split_bytes=split, allow_empty=True)
    batches, stats = read_both(source, LIBFM_SCHEMA, directory)
    text = decoded(directory / "f")
    lines = lines_by_offset(text)
    offsets = check_counts(lines, batches, stats)
    cut = max(lines) if stats["units_failed"] and lines and not text.endswith(b"\n") else None
    good = {offset for offset, line in lines.items() if offset != cut and libfm_line_is_good(line)}
    assert set(offsets) == good, "a good line skipped, or a bad one delivered"
    for batch in batches:
        users, _ = batch.sparse.feature("user")
        items, _ = batch.sparse.feature("item")
        tag_ids, tag_lengths = batch.sparse.feature("tag")
        tag_rows = np.split(tag_ids, np.cumsum(tag_lengths)[:-1])
        for index, row_id in enumerate(batch.row_ids):
            line = lines[int(row_id) & OFFSET_MASK].decode("utf-8", errors="replace")
            expected = parse_line_reference(line)
            assert not isinstance(expected, str), (line, expected)
            label, found = expected
            assert batch.labels[index] == label, line
            assert [users[index]] == [i for i in found if i <= 9], line
            assert [items[index]] == [i for i in found if 10 <= i <= 29], line
            assert tag_rows[index].tolist() == [i for i in found if 30 <= i <= 39], line


@FUZZ
@given(
    pairs=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 50)), max_size=12),
    mutations=MUTATIONS,
    damage=DAMAGE,
)
def test_interactions_reader_survives_fuzzed_input(
    tmp_path_factory: pytest.TempPathFactory,
    pairs: list[tuple[int, int]],
    mutations: list[tuple[str, int, bytes]],
    damage: Any,
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "f"
    store(path, mutate("".join(f"{u} {i}\n" for u, i in pairs).encode(), mutations), damage)
    with contextlib.suppress(BadRowError):  # raise: read it all, or raise the reader's named error
        load_interactions([path])
    errors = BadRows("skip")
    data = load_interactions([path], errors=errors)
    text = decoded(path)
    lines = lines_by_offset(text)
    cut = max(lines) if errors.snapshot().failed_units and lines and not text.endswith(b"\n") else None
    good = []
    for offset, line in lines.items():
        fields = line.split(b" ") if offset != cut else []
        if len(fields) == 2 and all(re.fullmatch(rb"\t*-?[0-9]+\t*", f) for f in fields):
            user, item = int(fields[0]), int(fields[1])
            if user >= 0 and item >= 1:
                good.append((user, item))
    assert errors.count == len(lines) - data.items.size
    assert sorted(
        zip(np.repeat(data.users, np.diff(data.offsets)).tolist(), data.items.tolist(), strict=True)
    ) == sorted(good)
