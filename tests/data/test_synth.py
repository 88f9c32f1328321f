"""Synthetic Criteo-shaped data: layout, missing values, determinism, the same rows as always, a
learnable label."""

import hashlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score

from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import CRITEO_CARDINALITIES, criteo_schema, write_synthetic_criteo


def test_layout_missing_values_and_determinism(tmp_path: Path) -> None:
    first = write_synthetic_criteo(tmp_path / "a", rows=1000, files=2, seed=5, cardinality_scale=0.01)
    again = write_synthetic_criteo(tmp_path / "b", rows=1000, files=2, seed=5, cardinality_scale=0.01)
    assert [p.name for p in first] == ["part-00000.parquet", "part-00001.parquet"]
    table = pq.read_table(first[0])
    assert table.column_names == ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    assert table.num_rows == 500 and table.equals(pq.read_table(again[0]))
    assert 0.1 < np.mean(table.column("label").to_numpy()) < 0.4
    assert table.column("I1").null_count > 0 and table.column("C19").null_count > 0
    assert min(table.column("I5").drop_null().to_pylist()) >= 0
    assert all(len(v) == 8 for v in table.column("C1").drop_null().to_pylist())
    # Zipf: the most frequent id of C3 covers many rows; distinct ids stay within the scaled cardinality
    c3 = table.column("C3").drop_null().to_pylist()
    values, counts = np.unique(c3, return_counts=True)
    assert counts.max() > 0.05 * len(c3) and len(values) <= round(CRITEO_CARDINALITIES[2] * 0.01)


def test_the_generated_rows_stay_the_same(tmp_path: Path) -> None:
    """A seed and scale name one dataset: the quickstart's cached copy (`psrec.train.data_sources`)
    is keyed by them and the published figures were measured on them, so a faster generator must
    write the same values and the same missing ones (the digest of rows written by the generator
    those figures used)."""
    paths = write_synthetic_criteo(tmp_path, rows=3000, seed=11, cardinality_scale=0.01, chunk_rows=1024)
    table = pq.read_table(paths[0])
    digest = hashlib.sha256(repr(table.to_pydict()).encode()).hexdigest()
    assert digest == "cb7990a2ed77d5d1e12e134e82c274c10572bde7ccd36ee72414923d71ccda5c"


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format"):
        write_synthetic_criteo(tmp_path, rows=10, format="orc")


def test_label_is_learnable(tmp_path: Path) -> None:
    write_synthetic_criteo(tmp_path, rows=24000, seed=3, cardinality_scale=0.001, row_group_rows=10000)
    source = DataSource(format="parquet", paths=["*.parquet"])
    with open_reader(source, criteo_schema(), batch_size=24000, base_dir=tmp_path) as reader:
        batch = next(iter(reader))
    # Naive-Bayes-style score: sum over features of each id's smoothed log-odds on the training rows.
    ids = batch.sparse.ids.reshape(26, -1)  # (F, B), one id per row and feature
    train, labels = slice(0, 18000), batch.labels[:18000]
    prior = labels.mean()
    score = np.zeros(batch.batch_size - 18000)
    for feature_ids in ids:
        values, inverse = np.unique(feature_ids[train], return_inverse=True)
        positives = np.bincount(inverse, weights=labels, minlength=values.size)
        counts = np.bincount(inverse, minlength=values.size)
        rate = (positives + 20 * prior) / (counts + 20)
        where = np.searchsorted(values, feature_ids[18000:]).clip(0, values.size - 1)
        known = values[where] == feature_ids[18000:]
        score += np.where(known, np.log(rate[where] / (1 - rate[where])), np.log(prior / (1 - prior)))
    auc = roc_auc_score(batch.labels[18000:], score)
    assert auc > 0.7, auc  # Bayes-optimal ~0.80
