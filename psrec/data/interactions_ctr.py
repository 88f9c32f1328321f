"""User -> item interaction files framed as CTR (next item vs a sampled negative), written as Parquet.

BST (Chen et al. 2019) and other target-attention CTR models read rows (user, behaviour history,
target item, click label). From an interaction file ("user item" lines, each user's items in time
order, e.g. ../shared/data/ml-1m/ml-1m.txt) this module writes such rows with the SASRec
leave-one-out split (`psrec.data.sequences.InteractionData.split`): per user, s = training sequence,
v = validation item, t = test item (users with < 3 actions: everything is training).

- train: for the last `positions_per_user` positions i >= 1 of s, two rows with history
  s[max(0, i - max_length):i] (oldest first): target s[i], label 1, and a negative target, label 0,
  uniform over the items not in s (as SASRec samples its training negatives);
- validation: history = last `max_length` items of s; target v (label 1) and one negative (label 0);
- test: history = last `max_length` items of s + [v]; target t (label 1) and one negative (label 0).

Validation and test negatives are uniform over the items the user never interacted with (as SASRec's
evaluation samples them). A target never appears at its own position of the history, and no history
holds an item at or after its target's position. Negatives come from rng(seed, user, split), so the
output is a pure function of (file, max_length, positions_per_user, seed). Training rows are written
in a seeded random order (the trainer's shuffle buffer then mixes batches further); validation and
test rows in user order.

Columns: ``label`` (float32), ``user`` (int64), ``item`` (int64, the target), ``history``
(list<int64>). Schema for a run config: sparse ``user`` and ``item`` (namespace ``item``), sequence
``history`` (table of ``item``, namespace ``item``, max_length = `max_length`), all ``hashed: false``.

Run: ``psrec data interactions-ctr ../shared/data/ml-1m/ml-1m.txt data/ml1m_ctr --max-length 50``
(writes data/ml1m_ctr/{train,validation,test}/part-0.parquet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from psrec.data.sequences import InteractionData, load_interactions, sample_negatives

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
_SPLIT_STREAM = {"train": 0, "validation": 1, "test": 2}


@dataclass
class _Rows:
    """Rows of one split under construction: labels, users, targets, and flat histories + lengths."""

    labels: list[np.ndarray]
    users: list[np.ndarray]
    items: list[np.ndarray]
    histories: list[np.ndarray]
    lengths: list[np.ndarray]

    @classmethod
    def empty(cls) -> _Rows:
        return cls([], [], [], [], [])

    def add(
        self, user: int, history: np.ndarray, lengths: np.ndarray, targets: np.ndarray, label: float
    ) -> None:
        self.labels.append(np.full(targets.size, label, np.float32))
        self.users.append(np.full(targets.size, user, np.int64))
        self.items.append(targets.astype(np.int64))
        self.histories.append(history.astype(np.int64))
        self.lengths.append(lengths.astype(np.int32))

    def table(self, order: np.ndarray | None = None) -> pa.Table:
        def flat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        labels, users, items = (
            flat(self.labels, np.float32),
            flat(self.users, np.int64),
            flat(self.items, np.int64),
        )
        lengths, values = flat(self.lengths, np.int32), flat(self.histories, np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        if order is not None:
            labels, users, items = labels[order], users[order], items[order]
            index = _ranges(starts[order], lengths[order])
            values, lengths = values[index], lengths[order]
            starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        history = pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), pa.array(values))
        return pa.table({"label": labels, "user": users, "item": items, "history": history})


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[k], starts[k] + lengths[k]) (int64)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths, dtype=np.int64)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


def _window_histories(
    sequence: np.ndarray, positions: np.ndarray, max_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """(flat histories, lengths) of sequence[max(0, i - max_length):i] for each position i."""
    firsts = np.maximum(positions - max_length, 0)
    lengths = (positions - firsts).astype(np.int64)
    return sequence[_ranges(firsts, lengths)], lengths


def _rng(seed: int, user: int, split: str) -> np.random.Generator:
    return np.random.default_rng([seed, user, _SPLIT_STREAM[split]])


def build_ctr_rows(
    data: InteractionData, *, max_length: int, positions_per_user: int, seed: int
) -> dict[str, pa.Table]:
    """The train/validation/test CTR tables of `data` (see the module docstring)."""
    if max_length < 1 or positions_per_user < 1:
        raise ValueError(
            f"max_length and positions_per_user must be >= 1, got {max_length}, {positions_per_user}"
        )
    rows = {split: _Rows.empty() for split in SPLITS}
    for index in range(data.users.size):
        user = int(data.users[index])
        train, valid, test = data.split(index)
        if train.size >= 2:
            positions = np.arange(max(1, train.size - positions_per_user), train.size)
            history, lengths = _window_histories(train, positions, max_length)
            negatives = sample_negatives(_rng(seed, user, "train"), positions.size, data.num_items, train)
            rows["train"].add(user, history, lengths, train[positions], 1.0)
            rows["train"].add(user, history, lengths, negatives, 0.0)
        if valid is None or test is None:
            continue
        everything = data.history(index)
        for split, sequence, target in (
            ("validation", train, valid),
            ("test", np.append(train, valid), test),
        ):
            history = sequence[-max_length:]
            lengths = np.array([history.size])
            negative = sample_negatives(_rng(seed, user, split), 1, data.num_items, everything)
            rows[split].add(user, history, lengths, np.array([target]), 1.0)
            rows[split].add(user, history, lengths, negative, 0.0)
    count = sum(parts.size for parts in rows["train"].labels)
    order = np.random.default_rng([seed, 3]).permutation(count)
    return {
        "train": rows["train"].table(order),
        "validation": rows["validation"].table(),
        "test": rows["test"].table(),
    }


def write_interactions_ctr(
    inputs: list[Path] | list[str],
    output_dir: str | Path,
    *,
    max_length: int = 50,
    positions_per_user: int = 50,
    seed: int = 0,
    row_group_rows: int = 65536,
) -> dict[str, int]:
    """Write OUTPUT_DIR/{train,validation,test}/part-0.parquet; returns the row count of each split."""
    data = load_interactions([Path(path) for path in inputs])
    tables = build_ctr_rows(data, max_length=max_length, positions_per_user=positions_per_user, seed=seed)
    counts = {}
    for split, table in tables.items():
        directory = Path(output_dir) / split
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / "part-0.parquet.tmp"
        pq.write_table(table, temporary, row_group_size=row_group_rows)
        temporary.replace(directory / "part-0.parquet")
        counts[split] = table.num_rows
        logger.info("wrote %d %s rows to %s", table.num_rows, split, directory)
    return counts
