import subprocess
import sys

import numpy as np
import pytest

from psrec import SparseBatch


def test_import_has_no_side_effects() -> None:
    code = (
        "import logging, sys, psrec; assert 'ray' not in sys.modules; assert not logging.getLogger().handlers"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_batch_worked_example() -> None:
    batch = SparseBatch.from_features(
        {"user": (np.array([11, 12]), np.array([1, 1])), "tags": (np.array([7, 8]), np.array([2, 0]))}
    )
    assert batch.keys == ("user", "tags")
    assert batch.ids.tolist() == [11, 12, 7, 8]
    assert batch.lengths.tolist() == [1, 1, 2, 0]
    assert batch.offsets.tolist() == [0, 1, 2, 4, 4]
    ids, lengths = batch.feature("tags")
    assert ids.tolist() == [7, 8] and lengths.tolist() == [2, 0]
    assert batch.batch_size == 2


def test_sparse_batch_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="lengths sum"):
        SparseBatch(("a",), np.array([1, 2], dtype=np.int64), np.array([1], dtype=np.int32))
    with pytest.raises(TypeError, match="int64"):
        SparseBatch(("a",), np.array([1], dtype=np.int32), np.array([1], dtype=np.int32))


def test_concat_batches_keeps_sample_order() -> None:
    from psrec.data.batch import Batch, concat_batches

    def batch(a: list[int], lengths: list[int], labels: list[float]) -> Batch:
        sparse = SparseBatch.from_features({"a": (np.array(a), np.array(lengths))})
        n = len(labels)
        return Batch(np.array(labels, np.float32), np.zeros((n, 1), np.float32), sparse, row_ids=np.arange(n))

    merged = concat_batches([batch([1, 2, 3], [2, 1], [0, 1]), batch([4], [1], [1])])
    assert merged.sparse.ids.tolist() == [1, 2, 3, 4]
    assert merged.sparse.lengths.tolist() == [2, 1, 1]
    assert merged.labels.tolist() == [0, 1, 1] and merged.row_ids.tolist() == [0, 1, 0]


def test_public_names_resolve_lazily() -> None:
    code = (
        "import sys, psrec; assert 'torch' not in sys.modules; "
        "assert set(psrec.__all__) == set(psrec._EXPORTS); [getattr(psrec, n) for n in psrec.__all__]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shard_actors_start_without_torch() -> None:
    """A shard process imports only the shard side (the actor module and what it reaches): no torch,
    whose import (and its compiler stack) would cost every shard start seconds."""
    code = "import sys, psrec.ps.actors; assert 'torch' not in sys.modules, 'the shard side imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
