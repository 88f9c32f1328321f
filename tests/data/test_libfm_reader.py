"""libfm reading with a field map: kernel vs oracle, bad tokens, sharding + resume, Frappe (if present)."""

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psrec.data.errors import BadRowError
from psrec.data.libfm_format import parse_block, parse_line_reference
from psrec.data.lines import line_spans
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, Schema, SparseFeature
from psrec.data.units import OFFSET_BITS

FRAPPE_FIELDS = {
    "user": (0, 956), "item": (957, 5038), "daytime": (5039, 5045), "weekday": (5046, 5052),
    "isweekend": (5053, 5054), "homework": (5055, 5057), "cost": (5058, 5059), "weather": (5060, 5068),
    "country": (5069, 5148), "city": (5149, 5381),
}  # fmt: skip
FIELDS = {"user": (0, 9), "item": (10, 29), "tag": (30, 39)}
SCHEMA = Schema(
    label="label",
    sparse=[
        SparseFeature(name="user", table="users", hashed=False),
        SparseFeature(name="item", table="items", hashed=False),
        SparseFeature(name="tag", table="tags", multi_valued=True),
    ],
)


def libfm_lines(rows: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        tags = [f"{rng.randint(30, 39)}:1" for _ in range(rng.randint(0, 2))]
        lines.append(
            " ".join([rng.choice(["1", "-1"]), f"{rng.randint(0, 9)}:1", f"{rng.randint(10, 29)}:1.0", *tags])
        )
    return lines


def write(path: Path, lines: list[str], end: str = "\r\n") -> Path:
    path.write_bytes((end.join(lines) + end).encode())
    return path


def source(*paths: str, **options: object) -> DataSource:
    return DataSource(format="libfm", paths=list(paths), field_ranges=FIELDS, split_bytes=1000, **options)  # type: ignore[arg-type]


def test_reads_fields_labels_and_crlf(tmp_path: Path) -> None:
    write(tmp_path / "a.libfm", ["1 3:1 12:1 31:1 33:1", "-1 4:1 10:1", "0 5:1 11:1 35:1"])
    with open_reader(source("a.libfm"), SCHEMA, batch_size=10, base_dir=tmp_path) as reader:
        (batch,) = list(reader)
    assert batch.labels.tolist() == [1.0, 0.0, 0.0]
    assert batch.sparse.feature("user")[0].tolist() == [3, 4, 5]
    assert batch.sparse.feature("item")[0].tolist() == [12, 10, 11]
    tag_ids, tag_lengths = batch.sparse.feature("tag")
    assert tag_lengths.tolist() == [2, 0, 1] and (tag_ids >= 0).all()
    assert batch.row_ids.tolist() == [0, 22, 35]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("x 3:1 12:1", "label is not a number"),
        ("1 3:1 12", "token is not id:number ('12')"),
        ("1 3:1 12:abc", "token is not id:number ('12:abc')"),
        ("1 3:1 77:1", "feature id 77 is in no field"),
        ("1 3:1 4:1 12:1", "field 'user' has 2 ids, expected 1"),
        ("1 12:1", "field 'user' has 0 ids, expected 1"),
    ],
)
def test_bad_lines_raise_or_skip(tmp_path: Path, line: str, reason: str) -> None:
    lines = libfm_lines(4, seed=1) + [line] + libfm_lines(3, seed=2)
    write(tmp_path / "b.libfm", lines)
    with pytest.raises(BadRowError) as error:
        list(open_reader(source("b.libfm"), SCHEMA, batch_size=100, base_dir=tmp_path))
    assert f"b.libfm, line 5: {reason}" in str(error.value) and line in str(error.value)
    with open_reader(source("b.libfm", on_error="skip"), SCHEMA, batch_size=100, base_dir=tmp_path) as reader:
        (batch,) = list(reader)
        assert reader.stats()["rows_skipped"] == 1
    assert batch.batch_size == 7
    assert batch.sparse.feature("user")[0].tolist() == [
        int(s.split()[1].split(":")[0]) for s in lines if s != line
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="0123456789:.-+eE \t ab", max_size=14), min_size=1, max_size=8))
def test_kernel_matches_reference(lines: list[str]) -> None:
    data = "\n".join(lines).encode()
    starts, ends = line_spans(data)
    labels, counts, ids, status, _ = parse_block(np.frombuffer(data, np.uint8), starts, ends)
    texts = [data[s:e].decode() for s, e in zip(starts, ends, strict=True)]
    position = 0
    for index, text in enumerate(texts):
        expected = parse_line_reference(text)
        if isinstance(expected, str):
            assert status[index] != 0, text
        else:
            assert status[index] == 0, text
            assert labels[index] == expected[0]
            assert ids[position : position + counts[index]].tolist() == expected[1]
            position += counts[index]


@pytest.mark.parametrize("shuffle_buffer", [0, 90])
def test_sharded_resume_is_exactly_once(
    harness: SimpleNamespace, tmp_path: Path, shuffle_buffer: int
) -> None:
    first = write(tmp_path / "p0.libfm", libfm_lines(300, seed=3))
    second = write(tmp_path / "p1.libfm", libfm_lines(200, seed=4), end="\n")
    expected = []
    for index, path in enumerate((first, second)):
        data = path.read_bytes()
        expected += [
            (index << OFFSET_BITS) + o for o in [0] + [i + 1 for i, b in enumerate(data[:-1]) if b == 10]
        ]
    harness.check_sharded_resume(
        source("p*.libfm"),
        SCHEMA,
        tmp_path,
        np.array(expected),
        seed=shuffle_buffer,
        batch_size=64,
        shuffle_buffer=shuffle_buffer,
    )


def test_frappe_test_split(shared_data: Path) -> None:
    path = shared_data / "frappe" / "frappe.test.libfm"
    if not path.is_file():
        pytest.skip("frappe not available")
    schema = Schema(
        label="label", sparse=[SparseFeature(name=n, table=n, hashed=False) for n in FRAPPE_FIELDS]
    )
    frappe = DataSource(format="libfm", paths=[str(path)], field_ranges=FRAPPE_FIELDS)
    rows = positives = 0
    with open_reader(frappe, schema, batch_size=8192) as reader:
        for batch in reader:
            rows += batch.batch_size
            positives += int(batch.labels.sum())
            assert (batch.sparse.lengths == 1).all()
            for name, (low, high) in FRAPPE_FIELDS.items():
                ids = batch.sparse.feature(name)[0]
                assert ids.min() >= low and ids.max() <= high
    assert (rows, positives) == (28860, 9536)  # PROVENANCE.txt
