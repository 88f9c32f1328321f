"""The growing-file stream source: files that land while it runs are read once, in order, resumably.

Every row written carries its own number in the dense column `x`, so the oracle is the list of
numbers written (and, for the rows' decoded content, psrec's finished-file reader `open_reader` over
the final list of files in the same order). Files are published whole (written under a hidden name,
then renamed) unless a test writes one in place on purpose. Waits are bounded: the source is polled
every 50 ms and ends 0.2-1 s after the last file (`idle_timeout_s`).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psrec.data.batch import Batch, concat_batches
from psrec.data.errors import BadRowError
from psrec.data.growing_source import GrowingFiles, matches, open_growing_reader, shard_of
from psrec.data.reader import BatchReader, open_reader
from psrec.data.schema import DataSource, DenseFeature, Schema, SparseFeature
from psrec.storage import StoragePath

SCHEMA = Schema(label="label", dense=[DenseFeature(name="x")], sparse=[SparseFeature(name="c", table="c")])
FAST = GrowingFiles(poll_seconds=0.05)
HEADER = "label,x,c\n"
T = TypeVar("T")


def lines(numbers: Iterable[int]) -> str:
    return "".join(f"{n % 2},{n},c{n % 7}\n" for n in numbers)


def publish(path: Path, text: str, *, mtime_s: float | None = None) -> Path:
    """Write `text` to `path` whole: under a hidden name first, then renamed (as writers publish)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden = path.with_name(f".{path.name}.tmp")
    hidden.write_text(text)
    if mtime_s is not None:
        os.utime(hidden, (mtime_s, mtime_s))
    os.replace(hidden, path)
    return path


def write_csv(path: Path, numbers: Iterable[int], *, mtime_s: float | None = None) -> Path:
    return publish(path, HEADER + lines(numbers), mtime_s=mtime_s)


def numbers_of(batches: list[Batch]) -> list[int]:
    return [int(value) for batch in batches for value in batch.dense[:, 0]]


def csv_source(*paths: str, **options: Any) -> DataSource:
    return DataSource(format="csv", paths=list(paths), **options)


def within(seconds: float, action: Callable[[], T]) -> T:
    """`action()`, run in a thread: a reader that never ends fails the test instead of hanging it."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(action())
        except BaseException as error:  # re-raised in the test's thread
            failure.append(error)

    thread = in_thread(run)
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"not done within {seconds} s")
    if failure:
        raise failure[0]
    return result[0]


def read(reader: BatchReader, stop_after: int | None = None) -> list[Batch]:
    """The reader's batches (the first `stop_after`), then closed; at most 10 s."""

    def consume() -> list[Batch]:
        with reader:
            batches = []
            for batch in reader:
                batches.append(batch)
                if stop_after is not None and len(batches) >= stop_after:
                    break
            return batches

    return within(10.0, consume)


def in_thread(action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def test_files_landing_while_it_reads_are_read_once_in_order(tmp_path: Path) -> None:
    names = [f"dt=2026-12-0{day}/part-{part}.csv" for day in (1, 2, 3) for part in (1, 2)]

    def writer() -> None:
        for index, name in enumerate(names[1:], start=1):
            time.sleep(0.08)
            write_csv(tmp_path / name, range(index * 40, index * 40 + 40))
            (tmp_path / name).with_name("_SUCCESS").write_text("")  # not data: ignored
            publish(tmp_path / "_temporary" / f"{index}.csv", "not,a,row\n")  # ignored

    write_csv(tmp_path / names[0], range(40))
    thread = in_thread(writer)
    reader = open_growing_reader(
        csv_source("dt=*/*.csv"), SCHEMA, batch_size=32, base_dir=tmp_path, growing=FAST, idle_timeout_s=0.6
    )
    batches = read(reader)
    thread.join(5)
    assert numbers_of(batches) == list(range(240))
    stats = reader.stats()
    assert (stats["files_read"], stats["files_pending"], stats["rows_read"]) == (6, 0, 240)
    assert max(batch.batch_size for batch in batches[:-1]) == 32 == min(b.batch_size for b in batches[:-1])
    row_ids = np.concatenate([batch.row_ids for batch in batches])
    assert np.unique(row_ids).size == row_ids.size
    newest = max((tmp_path / name).stat().st_mtime_ns // 1_000_000 for name in names)
    assert reader.position()["newest_event_ms"] == newest
    # Oracle: the finished-file reader over the final files in name order decodes the same rows.
    with open_reader(csv_source(*names), SCHEMA, batch_size=1000, base_dir=tmp_path, prefetch=0) as oracle:
        expected = concat_batches(list(oracle))
    got = concat_batches(batches)
    np.testing.assert_array_equal(got.labels, expected.labels)
    np.testing.assert_array_equal(got.dense, expected.dense)
    np.testing.assert_array_equal(got.sparse.ids, expected.sparse.ids)


def test_two_shards_read_disjoint_shares_that_cover_every_row(tmp_path: Path) -> None:
    for index in range(12):
        write_csv(tmp_path / f"part-{index:02d}.csv", range(index * 10, index * 10 + 10))
    shares = []
    for shard in (0, 1):
        reader = open_growing_reader(
            csv_source("*.csv"), SCHEMA, batch_size=7, shard=shard, num_shards=2, base_dir=tmp_path,
            growing=FAST, idle_timeout_s=0.2,
        )  # fmt: skip
        batches = read(reader)
        mine = [index for index in range(12) if shard_of(f"part-{index:02d}.csv", 2) == shard]
        assert mine, "both shards must get files: change the file names"
        assert all(zlib.crc32(f"part-{i:02d}.csv".encode()) % 2 == shard for i in mine)  # documented
        assert numbers_of(batches) == [n for index in mine for n in range(index * 10, index * 10 + 10)]
        shares.append(batches)
    assert sorted(numbers_of(shares[0]) + numbers_of(shares[1])) == list(range(120))
    row_ids = np.concatenate([batch.row_ids for batches in shares for batch in batches])
    assert np.unique(row_ids).size == 120


def test_a_reader_reopened_from_its_position_goes_on_with_every_row_once(tmp_path: Path) -> None:
    """Stops after 1-3 batches (batches cut files in the middle; files are several byte-range units),
    JSON round trip of the position, files landing between readers: every row once, in order."""
    source = csv_source("*.csv", split_bytes=200)
    rng = random.Random(5)
    files = 4
    for index in range(files):
        write_csv(tmp_path / f"part-{index:02d}.csv", range(index * 70, index * 70 + 70))
    seen: list[Batch] = []
    position = None
    mid_file = 0
    for attempt in range(100):
        reader = open_growing_reader(
            source, SCHEMA, batch_size=25, base_dir=tmp_path, growing=FAST, idle_timeout_s=0.2,
            position=position,
        )  # fmt: skip
        stop_after = rng.randint(1, 3)
        batches = read(reader, stop_after)
        seen += batches
        position = json.loads(json.dumps(reader.position()))
        mid_file += position["current"] is not None and position["current"]["unit"] > 0
        if len(batches) < stop_after:  # the source ended
            break
        if attempt % 3 == 0 and files < 7:  # a file lands while no reader runs
            write_csv(tmp_path / f"part-{files:02d}.csv", range(files * 70, files * 70 + 70))
            files += 1
    assert numbers_of(seen) == list(range(files * 70))
    assert mid_file > 0, "no stop inside a file past its first unit: the test does not test it"
    assert position is not None and position["format"] == "growing" and position["version"] == 1
    assert position["current"] is None and position["file_number"] == files


def test_order_by_time_ties_by_name(tmp_path: Path) -> None:
    now = time.time()
    mtimes = {"a.csv": now - 30, "b.csv": now - 10, "c.csv": now - 50, "d.csv": now - 30}
    for index, (name, mtime) in enumerate(mtimes.items()):
        write_csv(tmp_path / name, range(index * 5, index * 5 + 5), mtime_s=mtime)
    by_time = GrowingFiles(order="time", poll_seconds=0.05)
    reader = open_growing_reader(
        csv_source("*.csv"), SCHEMA, batch_size=100, base_dir=tmp_path, growing=by_time, idle_timeout_s=0.2
    )
    order = [numbers // 5 for numbers in numbers_of(read(reader))[::5]]
    assert order == [2, 0, 3, 1]  # c, then a and d (same time: by name), then b
    assert reader.position()["watermark"][1:] == ["b.csv", 0]


def test_a_late_file_is_read_next_and_counted(tmp_path: Path) -> None:
    write_csv(tmp_path / "b.csv", range(20, 40))
    write_csv(tmp_path / "c.csv", range(40, 60))
    reader = open_growing_reader(
        csv_source("*.csv"), SCHEMA, batch_size=20, base_dir=tmp_path, growing=FAST, idle_timeout_s=0.5,
        prefetch=0,
    )  # fmt: skip

    def consume() -> list[Batch]:
        with reader:
            batches = iter(reader)
            first = [next(batches), next(batches)]
            write_csv(tmp_path / "a.csv", range(20))  # sorts before the files read already
            return first + list(batches)

    assert numbers_of(within(5.0, consume)) == list(range(20, 60)) + list(range(20))
    assert reader.stats()["files_late"] == 1


def test_late_files_landing_between_readers_and_the_bounded_position(tmp_path: Path) -> None:
    """A late file inside the lateness window is read on resume; one older than it is taken as read
    (the documented limit); the position lists only the files read within the window."""
    now = time.time()
    for index in range(10):  # modification times 30 s apart, the newest now
        write_csv(tmp_path / f"f{index + 1:02d}.csv", [index + 1], mtime_s=now - 30 * (9 - index))
    growing = GrowingFiles(poll_seconds=0.05, lateness_seconds=100)
    options: dict[str, Any] = {"batch_size": 100, "base_dir": tmp_path, "growing": growing}
    reader = open_growing_reader(csv_source("*.csv"), SCHEMA, idle_timeout_s=0.2, **options)
    assert numbers_of(read(reader)) == list(range(1, 11))
    position = json.loads(json.dumps(reader.position()))
    assert [name for name, _, _ in position["recent"]] == ["f07.csv", "f08.csv", "f09.csv", "f10.csv"]
    write_csv(tmp_path / "f00.csv", [0])  # late (sorts first), modified now: read
    write_csv(tmp_path / "f05b.csv", [55], mtime_s=now - 3600)  # late and older than the window: lost
    resumed = open_growing_reader(
        csv_source("*.csv"), SCHEMA, position=position, idle_timeout_s=0.2, **options
    )
    assert numbers_of(read(resumed)) == [0]
    assert resumed.stats()["files_late"] == 1


def test_a_file_written_in_place_is_read_only_once_settled(tmp_path: Path) -> None:
    target = tmp_path / "part-0.csv"
    finished = []

    def writer() -> None:
        with open(target, "w") as handle:
            handle.write(HEADER + lines(range(10)) + "1,10,c")  # ends inside a line
            handle.flush()
            time.sleep(0.3)  # shorter than settle_seconds: the file never looks finished
            handle.write("3\n" + lines(range(11, 30)))
        finished.append(time.monotonic())

    thread = in_thread(writer)
    growing = GrowingFiles(poll_seconds=0.05, settle_seconds=0.6)
    reader = open_growing_reader(
        csv_source("*.csv"), SCHEMA, batch_size=1000, base_dir=tmp_path, growing=growing,
        max_batch_delay_s=0.05, idle_timeout_s=0.3,
    )  # fmt: skip

    def consume() -> list[tuple[float, Batch]]:
        with reader:
            return [(time.monotonic(), batch) for batch in reader]

    delivered = within(5.0, consume)
    thread.join(5)
    assert numbers_of([batch for _, batch in delivered]) == list(range(30))
    assert delivered[0][0] >= finished[0] + 0.3  # nothing read before the file settled (0.6 s after)
    assert delivered[0][1].sparse.feature("c")[0].size == 30


def test_bad_rows_and_files_are_skipped_and_counted_or_raise(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", range(0, 5))
    publish(tmp_path / "b.csv", HEADER + lines(range(5, 7)) + "1,oops,c\n" + lines(range(7, 10)))
    publish(tmp_path / "c.csv", "label,x\n1,2\n")  # lacks a column of the schema: a bad file
    write_csv(tmp_path / "d.csv", range(10, 15))
    options: dict[str, Any] = {"batch_size": 4, "base_dir": tmp_path, "growing": FAST, "idle_timeout_s": 0.2}
    reader = open_growing_reader(csv_source("*.csv", on_error="skip"), SCHEMA, **options)
    assert numbers_of(read(reader)) == list(range(15))
    stats = reader.stats()
    assert stats["rows_skipped"] == 1 and stats["files_read"] == 4
    sample = stats["skipped_samples"][0]
    assert sample["file"].endswith("b.csv") and sample["location"] == "line 4"
    assert stats["units_failed"] == 1 and stats["failed_units"][0]["file"].endswith("c.csv")
    with pytest.raises(BadRowError, match=r"b\.csv, line 4"):
        read(open_growing_reader(csv_source("*.csv"), SCHEMA, **options))


def test_an_object_store_prefix(s3_bucket: str) -> None:
    prefix = f"s3://{s3_bucket}/logs"

    def upload(day: int) -> None:
        numbers = np.arange(day * 30, day * 30 + 30)
        table = pa.table(
            {"label": numbers % 2, "x": numbers.astype(np.float64), "c": [f"c{n}" for n in numbers]}
        )
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=12)
        StoragePath(f"{prefix}/dt=2026-12-0{day + 1}/part-0.parquet").write_bytes(
            sink.getvalue().to_pybytes()
        )
        StoragePath(f"{prefix}/dt=2026-12-0{day + 1}/_SUCCESS").write_bytes(b"")

    def uploads() -> None:
        for day in (1, 2):
            time.sleep(0.1)
            upload(day)

    upload(0)
    thread = in_thread(uploads)
    source = DataSource(format="parquet", paths=[f"{prefix}/dt=*/*.parquet"])
    options: dict[str, Any] = {"batch_size": 20, "growing": FAST, "idle_timeout_s": 0.8}
    first = open_growing_reader(source, SCHEMA, **options)
    head = read(first, stop_after=2)  # stops inside the second file's first row groups
    thread.join(10)
    rest = read(open_growing_reader(source, SCHEMA, position=first.position(), **options))
    assert numbers_of(head + rest) == list(range(90))


def test_max_batch_delay_delivers_a_short_batch_from_a_quiet_stream(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", range(10))
    started = time.monotonic()
    reader = open_growing_reader(
        csv_source("*.csv"), SCHEMA, batch_size=1000, base_dir=tmp_path, growing=FAST, max_batch_delay_s=0.2
    )
    got: list[tuple[Batch | None, float]] = []
    consumer = in_thread(lambda: got.append((next(iter(reader), None), time.monotonic() - started)))
    consumer.join(2.0)  # bounded: a reader that never delivers fails below instead of hanging
    closer = in_thread(reader.close)  # the stream waits for files that never come: closing it
    closer.join(1.0)  # stops its thread promptly
    assert not closer.is_alive()
    batch, waited = got[0]
    assert batch is not None and batch.batch_size == 10 and 0.2 <= waited < 2.0
    started = time.monotonic()
    without = open_growing_reader(
        csv_source("*.csv"), SCHEMA, batch_size=1000, base_dir=tmp_path, growing=FAST, idle_timeout_s=0.5
    )
    assert [b.batch_size for b in read(without)] == [10] and time.monotonic() - started >= 0.5


def test_paths_directories_and_ignored_names(tmp_path: Path) -> None:
    for name, numbers in [("a/x.csv", [0]), ("a/b/y.csv", [1]), ("a/_temporary/z.csv", [2])]:
        write_csv(tmp_path / name, numbers)
    publish(tmp_path / "a" / ".y.csv.tmp2", "half")
    publish(tmp_path / "a" / "_SUCCESS", "")
    for pattern, expected in [("a", [1, 0]), ("a/**/*.csv", [1, 0]), ("a/*/*.csv", [1]), ("a/x.csv", [0])]:
        reader = open_growing_reader(
            csv_source(pattern), SCHEMA, batch_size=10, base_dir=tmp_path, growing=FAST, idle_timeout_s=0.1
        )
        assert numbers_of(read(reader)) == expected, pattern
    assert matches(["d=1", "h=2", "p.csv"], ["**", "*.csv"]) and matches(["p.csv"], ["**", "p.csv"])
    assert not matches(["d=1", "p.csv"], ["*.csv"]) and matches(["d=1", "p.csv"], ["d=*", "*"])


def test_a_position_of_another_shard_or_order_is_refused(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", range(3))
    options: dict[str, Any] = {"batch_size": 10, "base_dir": tmp_path, "growing": FAST, "idle_timeout_s": 0.1}
    reader = open_growing_reader(csv_source("*.csv"), SCHEMA, **options)
    read(reader)
    with pytest.raises(ValueError, match="num_shards"):
        open_growing_reader(csv_source("*.csv"), SCHEMA, num_shards=2, position=reader.position(), **options)
    by_time = {**options, "growing": GrowingFiles(order="time")}
    with pytest.raises(ValueError, match="order"):
        open_growing_reader(csv_source("*.csv"), SCHEMA, position=reader.position(), **by_time)
