"""`psrec data interactions-ctr`: interaction files framed as CTR rows (on generated files only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from psrec.cli import main
from psrec.data.interactions_ctr import write_interactions_ctr
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, Schema, SequenceFeature, SparseFeature

NUM_ITEMS = 60
MAX_LENGTH = 5
POSITIONS = 4


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[int]]]:
    """A 'user item' file of 40 users (1 to 30 distinct items each), lines of users interleaved."""
    rng = np.random.default_rng(7)
    sequences = {
        user: rng.choice(np.arange(1, NUM_ITEMS + 1), size=int(rng.integers(1, 31)), replace=False).tolist()
        for user in range(1, 41)
    }
    sequences[41] = [3, 4]  # < 3 actions: training only
    sequences[42] = [5, 6, 7]  # exactly 3: one training item, so no training row
    lines = [(user, item) for user, items in sequences.items() for item in items]
    order = np.argsort([user % 3 for user, _ in lines], kind="stable")  # users interleaved, items in order
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    path.write_text("".join(f"{lines[i][0]} {lines[i][1]}\n" for i in order))
    return path, sequences


def read_split(directory: Path, split: str) -> list[dict]:
    return pq.read_table(directory / split / "part-0.parquet").to_pylist()


@pytest.fixture(scope="module")
def written(
    interactions: tuple[Path, dict[int, list[int]]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("ctr")
    write_interactions_ctr(
        [interactions[0]], out, max_length=MAX_LENGTH, positions_per_user=POSITIONS, seed=3, row_group_rows=16
    )
    return out


def split_of(items: list[int]) -> tuple[list[int], int | None, int | None]:
    return (items[:-2], items[-2], items[-1]) if len(items) >= 3 else (items, None, None)


def test_counts_and_labels(written: Path, interactions: tuple[Path, dict[int, list[int]]]) -> None:
    sequences = interactions[1]
    expected_train = sum(
        2 * min(POSITIONS, len(split_of(s)[0]) - 1) for s in sequences.values() if len(split_of(s)[0]) >= 2
    )
    held_out = sum(1 for s in sequences.values() if len(s) >= 3)
    rows = {split: read_split(written, split) for split in ("train", "validation", "test")}
    assert len(rows["train"]) == expected_train
    assert len(rows["validation"]) == len(rows["test"]) == 2 * held_out
    for split_rows in rows.values():
        labels = [row["label"] for row in split_rows]
        assert labels.count(1.0) == labels.count(0.0) == len(labels) // 2
    assert pq.ParquetFile(written / "train" / "part-0.parquet").metadata.num_row_groups == -(
        -expected_train // 16
    )


def test_training_rows_are_prefixes_without_leakage(
    written: Path, interactions: tuple[Path, dict[int, list[int]]]
) -> None:
    sequences = interactions[1]
    seen_positions: dict[int, set[int]] = {}
    for row in read_split(written, "train"):
        train = split_of(sequences[row["user"]])[0]
        history, target = row["history"], row["item"]
        assert 1 <= len(history) <= MAX_LENGTH
        assert target not in history  # never in its own history
        # the history is the window of training items just before some position i
        candidates = [i for i in range(1, len(train)) if train[max(0, i - MAX_LENGTH) : i] == history]
        assert len(candidates) == 1
        position = candidates[0]
        assert position >= len(train) - POSITIONS  # only the last positions per user
        if row["label"] == 1.0:
            assert target == train[position]
            seen_positions.setdefault(row["user"], set()).add(position)
        else:
            assert target not in train and 1 <= target <= NUM_ITEMS  # negatives: items not trained on
    for user, positions in seen_positions.items():
        train = split_of(sequences[user])[0]
        assert positions == set(range(max(1, len(train) - POSITIONS), len(train)))
    assert 41 in seen_positions and 42 not in seen_positions


def test_validation_and_test_histories(
    written: Path, interactions: tuple[Path, dict[int, list[int]]]
) -> None:
    sequences = interactions[1]
    for split in ("validation", "test"):
        rows = read_split(written, split)
        users = [row["user"] for row in rows]
        assert users == sorted(users)
        for row in rows:
            items = sequences[row["user"]]
            train, valid, test = split_of(items)
            assert valid is not None and test is not None
            history = train if split == "validation" else [*train, valid]
            assert row["history"] == history[-MAX_LENGTH:]
            assert row["item"] not in row["history"]
            if row["label"] == 1.0:
                assert row["item"] == (valid if split == "validation" else test)
            else:
                assert row["item"] not in items  # never an item the user interacted with
        if split == "test":
            positives = [row for row in rows if row["label"] == 1.0]
            assert all(row["history"][-1] == split_of(sequences[row["user"]])[1] for row in positives)


def test_deterministic_given_seed(
    interactions: tuple[Path, dict[int, list[int]]], written: Path, tmp_path: Path
) -> None:
    write_interactions_ctr(
        [interactions[0]], tmp_path / "same", max_length=MAX_LENGTH, positions_per_user=POSITIONS, seed=3
    )
    write_interactions_ctr(
        [interactions[0]], tmp_path / "other", max_length=MAX_LENGTH, positions_per_user=POSITIONS, seed=4
    )
    for split in ("train", "validation", "test"):
        assert read_split(tmp_path / "same", split) == read_split(written, split)
    assert read_split(tmp_path / "other", "train") != read_split(written, "train")
    assert read_split(tmp_path / "other", "test") != read_split(written, "test")


def test_reads_back_as_bst_batches(written: Path) -> None:
    schema = Schema(
        label="label",
        sparse=[
            SparseFeature(name="user", table="users", hashed=False),
            SparseFeature(name="item", table="items", hashed=False, namespace="item"),
        ],
        sequences=[
            SequenceFeature(
                name="history", table="items", max_length=MAX_LENGTH, hashed=False, namespace="item"
            )
        ],
    )
    source = DataSource(format="parquet", paths=["test/*.parquet"])
    with open_reader(source, schema, batch_size=1 << 16, base_dir=written) as reader:
        (batch,) = list(reader)
    rows = read_split(written, "test")
    history = batch.sequences["history"]
    assert history.ids.shape == (len(rows), MAX_LENGTH)
    for index, row in enumerate(rows):
        kept = history.ids[index][history.mask[index]].tolist()
        assert kept == row["history"]  # right-aligned, most recent item last
        assert history.mask[index, -1]


def test_cli(
    interactions: tuple[Path, dict[int, list[int]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    args = ["data", "interactions-ctr", str(interactions[0]), str(out), "--max-length", "3"]
    assert main(args) == 0
    assert "validation" in capsys.readouterr().err
    assert all(len(row["history"]) <= 3 for row in read_split(out, "train"))
    assert main(["data", "interactions-ctr", str(tmp_path / "missing.txt"), str(out)]) == 1
    assert main([*args, "--max-length", "0"]) == 2
