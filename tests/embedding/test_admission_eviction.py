"""Admission (always, min_count sketch, probability) and eviction (TTL, max_rows) policies."""

from __future__ import annotations

import numpy as np

from psrec.embedding import AdmissionSpec, EmbeddingTable, EvictionSpec, SparseOptimizerSpec
from psrec.embedding.admission import Admission
from psrec.embedding.eviction import rows_to_evict


def _table(**options) -> EmbeddingTable:
    return EmbeddingTable("adm", 4, optimizer=SparseOptimizerSpec("sgd", lr=1.0), **options)


def test_min_count_admits_on_the_nth_sighting_and_drops_earlier_gradients() -> None:
    table = _table(admission=AdmissionSpec("min_count", min_count=3, sketch_width=4096))
    ids = np.array([11, 12], dtype=np.int64)
    initial = table.pull(ids, train=False)
    grads = np.ones((2, 4), dtype=np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(table.pull(ids), initial)
        table.push(ids, grads, step=1)  # dropped: not admitted yet
    assert table.num_rows == 0
    table.pull(ids[:1])
    assert table.num_rows == 1
    table.push(ids, grads, step=2)
    rows = table.pull(ids, train=False)
    np.testing.assert_allclose(rows[0], initial[0] - 1.0)
    np.testing.assert_array_equal(rows[1], initial[1])


def test_min_count_counts_duplicates_in_one_pull_and_eval_pulls_do_not_count() -> None:
    table = _table(admission=AdmissionSpec("min_count", min_count=2, sketch_width=4096))
    for _ in range(3):
        table.pull(np.array([5], np.int64), train=False)
    assert table.num_rows == 0
    table.pull(np.array([5, 5], np.int64))
    assert table.num_rows == 1


def test_sketch_never_undercounts() -> None:
    admission = Admission(
        AdmissionSpec("min_count", min_count=10**9, sketch_width=64, sketch_depth=2), seed=0
    )
    generator = np.random.default_rng(0)
    ids = generator.integers(0, 500, size=5000).astype(np.int64)
    admission.admit(ids)
    true_counts = np.bincount(ids, minlength=500)
    from psrec.embedding.admission import sketch_positions_numpy

    positions = sketch_positions_numpy(np.arange(500, dtype=np.int64), admission.sketch_seed, 2, 64)
    estimates = np.min(np.stack([admission.sketch[level, positions[level]] for level in range(2)]), axis=0)
    assert np.all(estimates >= true_counts)


def test_probability_admission_rate_and_reproducibility() -> None:
    ids = np.arange(20_000, dtype=np.int64)
    table = _table(admission=AdmissionSpec("probability", probability=0.25), seed=1)
    table.pull(ids)
    assert 0.23 < table.num_rows / ids.size < 0.27
    again = _table(admission=AdmissionSpec("probability", probability=0.25), seed=1)
    again.pull(ids)
    np.testing.assert_array_equal(again.export_state().ids, table.export_state().ids)
    assert _table(admission=AdmissionSpec("probability", probability=0.0)).pull(ids[:10]) is not None


def test_rows_to_evict_applies_ttl_then_lowest_frequency() -> None:
    rows = np.arange(6, dtype=np.int32)
    ids = np.array([10, 11, 12, 13, 14, 15], dtype=np.int64)
    counts = np.array([5, 1, 1, 9, 0, 3], dtype=np.uint32)
    last_step = np.array([100, 90, 95, 10, 100, 100], dtype=np.uint32)
    spec = EvictionSpec(ttl_steps=50, max_rows=3)
    victims = rows_to_evict(spec, step=100, rows=rows, ids=ids, counts=counts, last_step=last_step)
    # TTL removes row 3 (90 steps old); then lowest counts: row 4 (0), then row 1 (1, older than row 2)
    assert sorted(victims.tolist()) == [1, 3, 4]
    assert (
        rows_to_evict(EvictionSpec(), step=100, rows=rows, ids=ids, counts=counts, last_step=last_step).size
        == 0
    )


def test_max_rows_eviction_frees_memory_for_reuse() -> None:
    table = _table(eviction=EvictionSpec(max_rows=50))
    table.pull(np.arange(100, dtype=np.int64))
    hot = np.arange(50, 100, dtype=np.int64)
    table.push(hot, np.ones((50, 4), np.float32), step=1)
    payload = table.memory_bytes()["payload"]
    assert table.evict(step=1) == 50
    assert sorted(table.export_state().ids.tolist()) == hot.tolist()
    table.pull(np.arange(1000, 1050, dtype=np.int64))
    assert table.memory_bytes()["payload"] == payload
