"""User -> item interaction files turned into SASRec/BST training and evaluation batches.

Input: lines "user item" (integers, items >= 1; 0 is padding), each user's items in time order
(MovieLens-1M as SASRec ships it: ../shared/data/ml-1m/ml-1m.txt). Two leave-out splits
(`Holdout`, the interactions source's ``holdout``):

- ``"last_two"`` (SASRec: Kang & McAuley, ICDM'18, and its reference code): per user, the last item
  is the test target, the one before it the validation target, the rest the training sequence;
  users with fewer than 3 actions keep everything for training. Full ranking excludes every item of
  the user's input sequence.
- ``"last"`` (generative-recommenders, the HSTU paper's code: research/data/reco_dataset.py with
  ``ignore_last_n=1`` for training, ``0`` for evaluation): the last item is held out, everything
  before it is the training sequence; users with fewer than 2 actions keep everything. There is no
  separate validation item: "valid" and "test" both rank the last item (selecting epochs on it
  selects on test; the reference reports it at a fixed epoch count). Full ranking excludes only the
  input window, the last ``max_length`` items the model reads (the reference's ``invalid_ids`` =
  ``past_ids``), never the target.

Training (`open_reader` with `DataSource(format="interactions")` and `sasrec_schema(max_length)`):
one row per user whose training sequence has >= 2 items, row_id = user id. With s = the training
sequence, the batch's sequences are, right-aligned and cut to the last `max_length` positions::

    "seq": s[:-1]    input items                     (B, L) ids + mask
    "pos": s[1:]     next item at each position      (B, L), same mask
    "neg": one item per position, uniform over items the user never trained on, drawn from
           rng(seed, user) so a resumed epoch draws the same negatives (the reader's seed changes
           every epoch: fresh negatives per epoch)
    "negatives": only when the schema has it (SASRec's sampled softmax): N = its max_length items
           per user, uniform over the items the user never trained on (`negatives_from="unseen"`)
           or over all items (`"all"`), with replacement, drawn from the same rng after "neg";
           (B, N), scored by the user's positions or dealt to other positions (the model's
           `negatives_per`)

Evaluation (`evaluation_batches`): input = training sequence (+ the validation item for "test"),
last `max_length` items; `"candidates"` (B, 1 + num_negatives) = the held-out item first, then
`num_negatives` (100) items drawn uniformly from those the user never interacted with. Rank the
target among the candidates: HR@10 = rank < 10, NDCG@10 = 1 / log2(rank + 2).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from psrec.data.batch import Batch, PaddedSequence, SparseBatch
from psrec.data.errors import BadRows
from psrec.data.features import ROW_ID, pad_sequences
from psrec.data.lines import (
    DamagedStream,
    LineCounter,
    carriage_return_lines,
    check_not_empty,
    line_blocks,
    report_damage,
)
from psrec.data.schema import Schema, SequenceFeature
from psrec.data.units import Unit

logger = logging.getLogger(__name__)

USERS_PER_UNIT = 256
_INTEGER = re.compile(rb"\t*-?[0-9]+\t*")  # pyarrow trims tabs around a number
SEQUENCE_COLUMNS = ("seq", "pos", "neg")
NEGATIVES = "negatives"  # the optional (B, N) sampled-softmax negatives
Holdout = Literal["last_two", "last"]


@dataclass(frozen=True)
class InteractionData:
    """Every user's items in time order: `items[offsets[i]:offsets[i + 1]]` belong to `users[i]`."""

    users: np.ndarray  # (num_users,) int64, ascending
    offsets: np.ndarray  # (num_users + 1,) int64
    items: np.ndarray  # (num_interactions,) int64
    num_items: int  # largest item id

    def history(self, index: int) -> np.ndarray:
        return self.items[self.offsets[index] : self.offsets[index + 1]]

    def split(self, index: int, holdout: Holdout = "last_two") -> tuple[np.ndarray, int | None, int | None]:
        """(training sequence, validation item, test item) of the user at `index` (module docstring:
        with ``"last"`` the validation item is the test item)."""
        history = self.history(index)
        if holdout == "last":
            if history.size < 2:
                return history, None, None
            return history[:-1], int(history[-1]), int(history[-1])
        if history.size < 3:
            return history, None, None
        return history[:-2], int(history[-2]), int(history[-1])


def sasrec_schema(max_length: int, *, table: str = "items", num_negatives: int = 0) -> Schema:
    """The schema of interaction training batches: "seq", "pos", "neg" item sequences (ids pass through),
    and with `num_negatives` > 0 the sampled softmax's "negatives" (that many items per user)."""
    lengths = {name: max_length for name in SEQUENCE_COLUMNS}
    if num_negatives:
        lengths[NEGATIVES] = num_negatives
    return Schema(
        label="label",
        sequences=[
            SequenceFeature(name=name, table=table, max_length=length, hashed=False, namespace="item")
            for name, length in lengths.items()
        ],
    )


def _line_location(counter: LineCounter, offset: int) -> str:
    return f"line {counter(offset)}"


def _parse_lines(path: str, errors: BadRows) -> tuple[np.ndarray, np.ndarray]:
    """(users, items) of every good line of one file, in file order."""
    users, items = [], []
    counter = LineCounter(path)
    options = (
        pa_csv.ReadOptions(column_names=["user", "item"]),
        pa_csv.ParseOptions(delimiter=" ", quote_char=False),  # no quoting: a " is data
        pa_csv.ConvertOptions(column_types={"user": pa.int64(), "item": pa.int64()}, null_values=[]),
    )
    unit = Unit(0, path, 0, -1)
    blocks = line_blocks(unit)
    while True:
        try:
            block = next(blocks, None)
        except DamagedStream as damage:  # the lines before the damage are kept
            report_damage(errors, counter, unit, damage)
            break
        if block is None:
            break
        try:  # a lone CR would pass for a line end: such blocks take the line-by-line path
            table = pa_csv.read_csv(pa.py_buffer(block.data), *options)
            parsed = table.num_rows == block.starts.size and not carriage_return_lines(block).size
        except pa.ArrowInvalid:
            parsed = False
        if parsed:
            user, item = table.column("user").to_numpy(), table.column("item").to_numpy()
            good = (user >= 0) & (item >= 1)
        else:  # find the bad lines one by one (error path only)
            user = np.zeros(block.starts.size, np.int64)
            item = np.zeros(block.starts.size, np.int64)
            good = np.zeros(block.starts.size, bool)
            for line in range(block.starts.size):
                fields = block.data[int(block.starts[line]) : int(block.ends[line])].split(b" ")
                numbers = [int(f) for f in fields if _INTEGER.fullmatch(f)]  # what pyarrow reads as int64
                if len(fields) == 2 and len(numbers) == 2 and all(abs(n) < 1 << 63 for n in numbers):
                    user[line], item[line] = numbers
                    good[line] = user[line] >= 0 and item[line] >= 1
        for bad in np.flatnonzero(~good).tolist():
            offset = block.offset + int(block.starts[bad])
            errors.report(
                path,
                functools.partial(_line_location, counter, offset),
                "expected 'user item' with user >= 0 and item >= 1",
                block.line(bad),
            )
        users.append(user[good])
        items.append(item[good])
    return np.concatenate(users or [np.zeros(0, np.int64)]), np.concatenate(items or [np.zeros(0, np.int64)])


def load_interactions(
    paths: list[Path] | list[str], *, on_error: str = "raise", errors: BadRows | None = None
) -> InteractionData:
    """Read "user item" lines from `paths` (in order) and group them per user, keeping file order."""
    errors = errors or BadRows("skip" if on_error == "skip" else "raise")
    parts = [_parse_lines(str(path), errors) for path in paths]
    users = np.concatenate([u for u, _ in parts]) if parts else np.zeros(0, np.int64)
    items = np.concatenate([i for _, i in parts]) if parts else np.zeros(0, np.int64)
    order = np.argsort(users, kind="stable")
    users, items = users[order], items[order]
    unique, starts = np.unique(users, return_index=True)
    offsets = np.append(starts, users.size).astype(np.int64)
    logger.info(
        "loaded %d interactions of %d users, %d items", items.size, unique.size, int(items.max(initial=0))
    )
    return InteractionData(unique, offsets, items, int(items.max(initial=0)))


def sample_negatives(rng: np.random.Generator, count: int, num_items: int, exclude: np.ndarray) -> np.ndarray:
    """`count` items uniform over [1, num_items] minus `exclude` (with replacement)."""
    excluded = np.unique(exclude)
    if excluded.size >= num_items:
        raise ValueError("a user interacted with every item: no negative to sample")
    out = rng.integers(1, num_items + 1, size=count)
    if excluded.size == 0:
        return out
    while True:
        found = excluded[np.minimum(np.searchsorted(excluded, out), excluded.size - 1)]
        clash = found == out
        if not clash.any():
            return out
        out[clash] = rng.integers(1, num_items + 1, size=int(clash.sum()))


class InteractionsFormat:
    """Training rows (one per user) for `open_reader`; see `psrec.data.reader.FormatReader`."""

    def __init__(
        self,
        files: list[Path],
        schema: Schema,
        errors: BadRows,
        *,
        seed: int,
        allow_empty: bool = False,
        holdout: Holdout = "last_two",
        negatives_from: Literal["unseen", "all"] = "unseen",
    ) -> None:
        available = {"label", "user", *SEQUENCE_COLUMNS, NEGATIVES}
        wanted = set(schema.label_names) | set(schema.feature_names)
        if not wanted <= available:
            raise ValueError(
                f"interaction batches have columns {sorted(available)}; use sasrec_schema(max_length)"
            )
        self.schema = schema
        self.seed = seed
        self.holdout: Holdout = holdout
        self.negatives_from = negatives_from
        self.num_negatives = next((f.max_length for f in schema.sequences if f.name == NEGATIVES), 0)
        files = [path for path in files if check_not_empty(str(path), allow_empty=allow_empty)]
        self.data = load_interactions(files, errors=errors)
        self.eligible = np.array(
            [self.data.split(i, holdout)[0].size >= 2 for i in range(self.data.users.size)], dtype=bool
        )

    def units(self) -> list[Unit]:
        count = self.data.users.size
        return [
            Unit(0, "interactions", start, min(start + USERS_PER_UNIT, count))
            for start in range(0, count, USERS_PER_UNIT)
        ]

    def read(self, unit: Unit, after: int | None) -> Iterator[pa.Table]:
        """Rows of the users in `unit` whose id is above `after`."""
        users: list[int] = []
        inputs: list[np.ndarray] = []
        negatives: list[np.ndarray] = []
        shared: list[np.ndarray] = []  # "negatives", num_negatives per user
        for index in range(unit.start, unit.stop):
            user = int(self.data.users[index])
            if not self.eligible[index] or (after is not None and user <= after):
                continue
            train = self.data.split(index, self.holdout)[0]
            users.append(user)
            inputs.append(train)
            rng = np.random.default_rng([self.seed, user])
            negatives.append(sample_negatives(rng, train.size - 1, self.data.num_items, train))
            if self.num_negatives:
                exclude = train if self.negatives_from == "unseen" else train[:0]
                shared.append(sample_negatives(rng, self.num_negatives, self.data.num_items, exclude))
        if not users:
            return
        lengths = np.array([train.size - 1 for train in inputs], dtype=np.int32)
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))

        def lists(values: list[np.ndarray]) -> pa.Array:
            return pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(values).astype(np.int64)))

        user_ids = pa.array(users, pa.int64())
        columns = {
            "label": pa.array(np.zeros(len(users), np.float32)),
            "user": user_ids,
            "seq": lists([train[:-1] for train in inputs]),
            "pos": lists([train[1:] for train in inputs]),
            "neg": lists(negatives),
            ROW_ID: user_ids,
        }
        if self.num_negatives:
            shared_offsets = pa.array(np.arange(len(users) + 1, dtype=np.int32) * self.num_negatives)
            columns[NEGATIVES] = pa.ListArray.from_arrays(shared_offsets, pa.array(np.concatenate(shared)))
        yield pa.table(columns)


def _held_out(
    data: InteractionData, *, split: str, shard: int, num_shards: int, holdout: Holdout
) -> Iterator[tuple[int, int, np.ndarray, int]]:
    """(user index, user, input sequence, held-out item) of this shard's users with a held-out item."""
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', not {split!r}")
    for index in range(shard, data.users.size, num_shards):
        train, valid, test = data.split(index, holdout)
        if valid is None or test is None:
            continue
        if split == "valid" or holdout == "last":
            yield index, int(data.users[index]), train, valid
        else:
            yield index, int(data.users[index]), np.append(train, valid), int(test)


def evaluation_batches(
    data: InteractionData,
    *,
    split: str,
    max_length: int,
    batch_size: int,
    num_negatives: int = 100,
    seed: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    holdout: Holdout = "last_two",
) -> Iterator[Batch]:
    """Batches of users with a held-out item: "seq" (B, L) and "candidates" (B, 1 + num_negatives), target first.

    Users are sharded round-robin (user index mod num_shards); negatives come from rng(seed, user).
    """
    pending: list[tuple[int, np.ndarray, np.ndarray]] = []
    held_out = _held_out(data, split=split, shard=shard, num_shards=num_shards, holdout=holdout)
    for index, user, inputs, target in held_out:
        rng = np.random.default_rng([seed, user, 1])
        negatives = sample_negatives(rng, num_negatives, data.num_items, data.history(index))
        pending.append((user, inputs, np.concatenate(([target], negatives))))
        if len(pending) == batch_size:
            yield _evaluation_batch(pending, max_length)
            pending = []
    if pending:
        yield _evaluation_batch(pending, max_length)


@dataclass(frozen=True)
class FullRankingBatch:
    """Users to rank every item for: candidate column j is item j + 1 (items 1..num_items).

    ``batch``: "seq" (B, L) and "candidates" (1, num_items), shared by the batch; ``targets`` (B,) the
    held-out items' columns; ``seen`` (B, num_items) the items excluded from each user's ranking (its
    input sequence, or only its input window; the target itself never: `psrec.trainer.metrics.full_ranks`).
    """

    batch: Batch
    targets: np.ndarray
    seen: np.ndarray


def full_ranking_batches(
    data: InteractionData,
    *,
    split: str,
    max_length: int,
    batch_size: int,
    shard: int = 0,
    num_shards: int = 1,
    holdout: Holdout = "last_two",
) -> Iterator[FullRankingBatch]:
    """The users of `evaluation_batches` (same inputs, same order), each to rank all items.

    The input sequence is the training sequence (+ the validation item for "test" under
    ``"last_two"``), as in the sampled protocol. Marked ``seen``: with ``"last_two"`` every item in it
    (SASRec's full-ranking protocol: a user's own history is not recommended back), with ``"last"``
    only its last `max_length` items, the window the model reads (generative-recommenders').
    """
    all_items = np.arange(1, data.num_items + 1, dtype=np.int64)[None, :]  # (1, N)
    candidates = PaddedSequence(all_items, np.ones(all_items.shape, bool))
    pending: list[tuple[int, np.ndarray, int]] = []

    def flush() -> FullRankingBatch:
        batch = _evaluation_batch(
            [(user, inputs, all_items[0, :0]) for user, inputs, _ in pending], max_length
        )
        batch.sequences["candidates"] = candidates
        seen = np.zeros((len(pending), data.num_items), bool)
        excluded = [inputs[-max_length:] if holdout == "last" else inputs for _, inputs, _ in pending]
        rows = np.repeat(np.arange(len(pending)), [items.size for items in excluded])
        seen[rows, np.concatenate(excluded) - 1] = True
        targets = np.array([target - 1 for _, _, target in pending], dtype=np.int64)
        return FullRankingBatch(batch, targets, seen)

    held_out = _held_out(data, split=split, shard=shard, num_shards=num_shards, holdout=holdout)
    for _, user, inputs, target in held_out:
        pending.append((user, inputs, target))
        if len(pending) == batch_size:
            yield flush()
            pending = []
    if pending:
        yield flush()


def _evaluation_batch(rows: list[tuple[int, np.ndarray, np.ndarray]], max_length: int) -> Batch:
    lengths = np.array([inputs.size for _, inputs, _ in rows], dtype=np.int64)
    sequence = pad_sequences(np.concatenate([inputs for _, inputs, _ in rows]), lengths, max_length)
    candidates = np.stack([c for _, _, c in rows]).astype(np.int64)
    return Batch(
        labels=np.zeros(len(rows), np.float32),
        dense=np.zeros((len(rows), 0), np.float32),
        sparse=SparseBatch((), np.zeros(0, np.int64), np.zeros(0, np.int32)),
        sequences={
            "seq": sequence,
            "candidates": PaddedSequence(candidates, np.ones(candidates.shape, bool)),
        },
        row_ids=np.array([user for user, _, _ in rows], dtype=np.int64),
    )
