"""Interaction files -> SASRec training rows and leave-one-out evaluation batches; ml-1m (if present)."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from psrec.data.errors import BadRowError
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.sequences import evaluation_batches, load_interactions, sasrec_schema


def write_interactions(path: Path, users: int = 40, items: int = 60, seed: int = 0) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    histories = {
        user: rng.integers(1, items + 1, size=rng.integers(1, 30)).tolist() for user in range(1, users + 1)
    }
    path.write_text("".join(f"{user} {item}\n" for user, history in histories.items() for item in history))
    return histories


def test_leave_one_out_split(tmp_path: Path) -> None:
    (tmp_path / "i.txt").write_text("1 5\n1 6\n1 7\n1 8\n2 3\n2 4\n3 9\n1 2\n")
    data = load_interactions([tmp_path / "i.txt"])
    assert data.users.tolist() == [1, 2, 3] and data.num_items == 9
    train, valid, test = data.split(0)
    assert train.tolist() == [5, 6, 7] and (valid, test) == (8, 2)  # file order kept per user
    assert data.split(1)[0].tolist() == [3, 4] and data.split(1)[1:] == (None, None)


def test_training_rows(tmp_path: Path) -> None:
    histories = write_interactions(tmp_path / "i.txt")
    source = DataSource(format="interactions", paths=["i.txt"])
    with open_reader(source, sasrec_schema(max_length=8), batch_size=1000, base_dir=tmp_path) as reader:
        (batch,) = list(reader)
    seq, pos, neg = (batch.sequences[name] for name in ("seq", "pos", "neg"))
    assert seq.ids.shape == pos.ids.shape == neg.ids.shape == (batch.batch_size, 8)
    for row, user in enumerate(batch.row_ids.tolist()):
        history = histories[user]
        train = history[:-2] if len(history) >= 3 else history
        assert len(train) >= 2
        kept = min(len(train) - 1, 8)
        assert seq.ids[row, 8 - kept :].tolist() == train[:-1][-kept:]
        assert pos.ids[row, 8 - kept :].tolist() == train[1:][-kept:]
        assert seq.mask[row].sum() == kept and (seq.ids[row, : 8 - kept] == 0).all()
        assert (pos.mask[row] == seq.mask[row]).all() and (neg.mask[row] == seq.mask[row]).all()
        negatives = neg.ids[row, 8 - kept :]
        assert not set(negatives.tolist()) & set(train) and (negatives >= 1).all()
    eligible = [u for u, h in histories.items() if len(h[:-2] if len(h) >= 3 else h) >= 2]
    assert sorted(batch.row_ids.tolist()) == eligible


def test_evaluation_candidates(tmp_path: Path) -> None:
    histories = write_interactions(tmp_path / "i.txt", items=300)
    data = load_interactions([tmp_path / "i.txt"])
    for split in ("valid", "test"):
        batches = list(evaluation_batches(data, split=split, max_length=5, batch_size=7, num_negatives=100))
        users = np.concatenate([b.row_ids for b in batches]).tolist()
        assert users == [u for u, h in histories.items() if len(h) >= 3]
        for batch in batches:
            candidates = batch.sequences["candidates"].ids
            assert candidates.shape == (batch.batch_size, 101)
            for row, user in enumerate(batch.row_ids.tolist()):
                history = histories[user]
                target = history[-2] if split == "valid" else history[-1]
                inputs = history[:-2] if split == "valid" else history[:-1]
                assert candidates[row, 0] == target
                assert not set(candidates[row, 1:].tolist()) & set(history)
                kept = min(len(inputs), 5)
                assert batch.sequences["seq"].ids[row, 5 - kept :].tolist() == inputs[-kept:]
    again = next(evaluation_batches(data, split="test", max_length=5, batch_size=7))
    assert (again.sequences["candidates"].ids == batches[0].sequences["candidates"].ids).all()  # fixed seed


@pytest.mark.parametrize("shuffle_buffer", [0, 9])
def test_sharded_resume_is_exactly_once(
    harness: SimpleNamespace, tmp_path: Path, shuffle_buffer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("psrec.data.sequences.USERS_PER_UNIT", 5)
    histories = write_interactions(tmp_path / "i.txt", users=60)
    expected = [u for u, h in histories.items() if len(h[:-2] if len(h) >= 3 else h) >= 2]
    source = DataSource(format="interactions", paths=["i.txt"])
    harness.check_sharded_resume(
        source,
        sasrec_schema(6),
        tmp_path,
        np.array(expected),
        seed=7,
        batch_size=4,
        shuffle_buffer=shuffle_buffer,
    )


def test_bad_lines(tmp_path: Path) -> None:
    (tmp_path / "i.txt").write_text("1 5\n1 6\n1 x\n1 7\n2 0\n")
    with pytest.raises(BadRowError, match=r"i.txt, line 3: expected 'user item'.*'1 x'"):
        load_interactions([tmp_path / "i.txt"])
    data = load_interactions([tmp_path / "i.txt"], on_error="skip")
    assert data.items.tolist() == [5, 6, 7]


def test_movielens_1m(shared_data: Path) -> None:
    path = shared_data / "ml-1m" / "ml-1m.txt"
    if not path.is_file():
        pytest.skip("ml-1m not available")
    data = load_interactions([path])
    assert (data.users.size, data.num_items, data.items.size) == (6040, 3416, 999611)  # PROVENANCE.txt
    batch = next(evaluation_batches(data, split="test", max_length=200, batch_size=64))
    assert batch.sequences["candidates"].ids.shape == (64, 101)
