import numpy as np

from psrec.data.batch import SparseBatch


def test_features_are_found_from_the_key_starts():
    # user: one id per sample; tags: 2 then 0 ids; item: one id each
    batch = SparseBatch(
        ("user", "tags", "item"),
        np.array([11, 12, 7, 8, 21, 22], dtype=np.int64),
        np.array([1, 1, 2, 0, 1, 1], dtype=np.int32),
    )
    assert batch.key_starts.tolist() == [0, 2, 4, 6]
    ids, lengths = batch.feature("tags")
    assert ids.tolist() == [7, 8] and lengths.tolist() == [2, 0]
    ids, lengths = batch.feature("item")
    assert ids.tolist() == [21, 22] and lengths.tolist() == [1, 1]
    assert not batch.single_valued


def test_single_valued_when_every_sample_has_one_id_per_key():
    batch = SparseBatch.from_features(
        {"a": (np.array([1, 2]), np.array([1, 1])), "b": (np.array([3, 4]), np.array([1, 1]))}
    )
    assert batch.single_valued
    assert batch.feature("b")[0].tolist() == [3, 4]
