"""The batch types every stage of psrec passes around.

`SparseBatch` is psrec's one jagged structure for sparse (categorical) features: for each feature
key, each sample holds a variable number of int64 ids. It is stored key-major, like TorchRec's
KeyedJaggedTensor, as flat NumPy arrays so that it crosses Ray and numba without copies.

Worked example: two samples, features ``user`` (one id each) and ``tags`` (multi-valued)::

    sample 0: user=[11], tags=[7, 8]
    sample 1: user=[12], tags=[]

    keys    = ["user", "tags"]
    ids     = [11, 12, 7, 8]          # user ids of both samples, then tags ids of both samples
    lengths = [1, 1, 2, 0]            # (num_keys * batch_size,), key-major
    offsets = [0, 1, 2, 4, 4]         # derived: cumulative sum of lengths with a leading 0

    batch.feature("tags") -> (ids=[7, 8], lengths=[2, 0])

`Batch` bundles the sparse part with the dense features, the labels, padded sequences (for BST and
SASRec) and the data positions the batch came from (for exact-once accounting and resume).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SparseBatch:
    """Jagged int64 ids per (feature key, sample); see the module docstring for an example."""

    keys: tuple[str, ...]
    ids: np.ndarray  # (total_ids,) int64
    lengths: np.ndarray  # (num_keys * batch_size,) int32, key-major

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64:
            raise TypeError(f"SparseBatch.ids must be int64, got {self.ids.dtype}")
        if self.lengths.ndim != 1 or len(self.keys) == 0 and self.lengths.size:
            raise ValueError("SparseBatch.lengths must be 1-D with num_keys * batch_size entries")
        if self.keys and self.lengths.size % len(self.keys):
            raise ValueError(
                f"SparseBatch.lengths has {self.lengths.size} entries, not a multiple of {len(self.keys)} keys"
            )
        if int(self.lengths.sum()) != self.ids.size:
            raise ValueError(
                f"SparseBatch: lengths sum to {int(self.lengths.sum())} but there are {self.ids.size} ids"
            )

    @property
    def batch_size(self) -> int:
        return self.lengths.size // len(self.keys) if self.keys else 0

    @property
    def offsets(self) -> np.ndarray:
        """(num_keys * batch_size + 1,) int64 start of each (key, sample) run in `ids`."""
        out = np.zeros(self.lengths.size + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    @functools.cached_property
    def key_starts(self) -> np.ndarray:
        """(num_keys + 1,) int64: key k's ids are ``ids[key_starts[k]:key_starts[k + 1]]``."""
        out = np.zeros(len(self.keys) + 1, dtype=np.int64)
        if self.keys:
            np.cumsum(self.lengths.reshape(len(self.keys), -1).sum(axis=1, dtype=np.int64), out=out[1:])
        return out

    @functools.cached_property
    def single_valued(self) -> bool:
        """Every (key, sample) holds exactly one id."""
        return self.ids.size == self.lengths.size and bool((self.lengths == 1).all())

    def feature(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths) of one feature, both views into this batch's arrays."""
        k = self.keys.index(key)
        b = self.batch_size
        starts = self.key_starts
        return self.ids[starts[k] : starts[k + 1]], self.lengths[k * b : (k + 1) * b]

    @staticmethod
    def from_features(features: dict[str, tuple[np.ndarray, np.ndarray]]) -> SparseBatch:
        """Build from {key: (ids, lengths)}; every feature must have the same batch size."""
        keys = tuple(features)
        sizes = {len(lengths) for _, lengths in features.values()}
        if len(sizes) > 1:
            raise ValueError(f"features have different batch sizes: {sorted(sizes)}")
        ids = [np.asarray(i, dtype=np.int64) for i, _ in features.values()]
        lengths = [np.asarray(n, dtype=np.int32) for _, n in features.values()]
        return SparseBatch(
            keys,
            np.concatenate(ids) if ids else np.zeros(0, np.int64),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int32),
        )


@dataclass(frozen=True)
class PaddedSequence:
    """Ordered id lists padded to a fixed length: ids (B, L) int64 and mask (B, L) bool (True = real).

    Sequences are right-aligned (most recent item last), padding on the left, as SASRec does.
    """

    ids: np.ndarray
    mask: np.ndarray


@dataclass
class Batch:
    """One training/eval batch. Arrays are NumPy; the trainer turns them into tensors zero-copy."""

    labels: np.ndarray  # (B,) float32, or (B, num_labels)
    dense: np.ndarray  # (B, num_dense) float32; num_dense may be 0
    sparse: SparseBatch
    sequences: dict[str, PaddedSequence] = field(default_factory=dict)
    # Where the rows came from, for exact-once accounting: global row indices of the dataset.
    row_ids: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])


def concat_batches(batches: list[Batch]) -> Batch:
    """One batch holding the samples of `batches` in order (same keys and sequence names required)."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    keys = batches[0].sparse.keys
    if any(b.sparse.keys != keys for b in batches):
        raise ValueError("concat_batches: batches have different sparse keys")
    features = {}
    for key in keys:
        parts = [b.sparse.feature(key) for b in batches]
        features[key] = (np.concatenate([ids for ids, _ in parts]), np.concatenate([n for _, n in parts]))
    sequences = {
        name: PaddedSequence(
            np.concatenate([b.sequences[name].ids for b in batches]),
            np.concatenate([b.sequences[name].mask for b in batches]),
        )
        for name in batches[0].sequences
    }
    row_ids = None
    if all(b.row_ids is not None for b in batches):
        row_ids = np.concatenate([b.row_ids for b in batches])
    return Batch(
        labels=np.concatenate([b.labels for b in batches]),
        dense=np.concatenate([b.dense for b in batches]),
        sparse=SparseBatch.from_features(features) if keys else batches[0].sparse,
        sequences=sequences,
        row_ids=row_ids,
    )
