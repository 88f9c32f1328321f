"""TieredTable against the in-memory EmbeddingTable as oracle: same ids, same updates -> the same rows
to the bit, with a memory budget so small that most rows cycle through the disk tier."""

from __future__ import annotations

import numpy as np
import pytest

from psrec.embedding import (
    AdmissionSpec,
    EmbeddingTable,
    EvictionSpec,
    SparseOptimizerSpec,
    StorageSpec,
    TableSpec,
    TieredTable,
    build_table,
)
from psrec.embedding.disk_tier import RecordLayout
from psrec.embedding.sizes import disk_bytes_per_row, memory_rows_for_budget
from psrec.embedding.state import TableDelta, TableState

OPTIMIZERS = {
    "sgd": SparseOptimizerSpec("sgd", lr=0.1),
    "adagrad": SparseOptimizerSpec("adagrad", lr=0.1),
    "rowwise_adagrad": SparseOptimizerSpec("rowwise_adagrad", lr=0.1),
    "adam": SparseOptimizerSpec("adam", lr=0.01, weight_decay=0.01),
    "ftrl": SparseOptimizerSpec("ftrl", lr=0.1, ftrl_l1=0.001, ftrl_l2=0.01),
}
DIM = 8


def pair(tmp_path, *, optimizer="adagrad", precision="fp32", memory_rows=24, policy="lfu", **kwargs):
    arguments = dict(
        optimizer=OPTIMIZERS[optimizer],
        precision=precision,
        stochastic_rounding=precision != "fp32",
        seed=3,
        **kwargs,
    )
    oracle = EmbeddingTable("t", DIM, **arguments)
    tiered = TieredTable(
        "t", DIM, memory_rows=memory_rows, disk_dir=str(tmp_path), policy=policy, **arguments
    )
    return oracle, tiered


def zipf_batches(steps, *, batch=48, universe=400, seed=0):
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        ids = (rng.zipf(1.1, size=batch) % universe).astype(np.int64) * 7 - 50
        grads = rng.standard_normal((batch, DIM)).astype(np.float32)
        yield step, ids, grads


def assert_same_state(left: TableState | TableDelta, right: TableState | TableDelta) -> None:
    left_arrays, right_arrays = left.to_arrays(), right.to_arrays()
    assert sorted(left_arrays) == sorted(right_arrays)
    for key in left_arrays:
        if key == "config":
            continue
        a, b = left_arrays[key], right_arrays[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.tobytes() == b.tobytes(), key  # to the bit, NaN patterns included
    assert left.config == right.config


def train_both(oracle, tiered, steps, **batch_args):
    for step, ids, grads in zipf_batches(steps, **batch_args):
        expected = oracle.pull(ids)
        got = tiered.pull(ids)
        assert got.tobytes() == expected.tobytes(), f"step {step}"
        oracle.push(ids, grads, step=step)
        tiered.push(ids, grads, step=step)
        assert tiered.memory_tier_rows <= max(tiered.memory_rows, np.unique(ids).shape[0])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_same_rows_as_in_memory_table(tmp_path, optimizer, precision):
    oracle, tiered = pair(tmp_path, optimizer=optimizer, precision=precision)
    train_both(oracle, tiered, 40)
    assert tiered.num_rows == oracle.num_rows
    assert tiered.disk_tier_rows > 3 * tiered.memory_tier_rows  # most rows live on disk
    assert tiered.promotions > tiered.num_rows  # and come back, many times
    assert_same_state(tiered.export_state(), oracle.export_state())
    ids = oracle.export_state().ids
    probe = np.concatenate([ids, np.array([10**9, -(10**9)], dtype=np.int64)])
    assert tiered.pull(probe, train=False).tobytes() == oracle.pull(probe, train=False).tobytes()
    assert tiered.disk_tier_rows > 0  # evaluation pulls promote nothing


@pytest.mark.parametrize("policy", ["lfu", "lru", "lfu_aging"])
def test_every_policy_keeps_rows_exact(tmp_path, policy):
    oracle, tiered = pair(tmp_path, policy=policy, memory_rows=10)
    train_both(oracle, tiered, 25)
    assert_same_state(tiered.export_state(), oracle.export_state())


def test_push_of_cold_rows_without_pull(tmp_path):
    oracle, tiered = pair(tmp_path, memory_rows=5)
    ids = np.arange(40, dtype=np.int64)
    oracle.pull(ids)
    tiered.pull(ids)
    rng = np.random.default_rng(1)
    for step in range(1, 6):
        push_ids = rng.choice(ids, size=30)  # mostly cold, duplicates, no pull in between
        grads = rng.standard_normal((30, DIM)).astype(np.float32)
        oracle.push(push_ids, grads, step=step)
        tiered.push(push_ids, grads, step=step)
    assert_same_state(tiered.export_state(), oracle.export_state())


def test_full_and_delta_checkpoints_restore(tmp_path):
    (tmp_path / "a").mkdir()
    oracle, tiered = pair(tmp_path / "a", memory_rows=16)
    batches = list(zipf_batches(30))
    marker = None
    full: TableState | None = None
    for step, ids, grads in batches:
        for table in (oracle, tiered):
            table.pull(ids)
            table.push(ids, grads, step=step)
        if step == 10:
            full = tiered.export_state()
            assert_same_state(full, oracle.export_state())
            marker = tiered.delta_marker()
            assert marker == oracle.delta_marker()
        if step == 20:
            tiered.remove(np.array([-50, -43, 123456], dtype=np.int64))  # hot or cold, one absent
            oracle.remove(np.array([-50, -43, 123456], dtype=np.int64))
    delta = tiered.export_delta(marker)
    expected_delta = oracle.export_delta(marker)
    assert np.array_equal(np.sort(delta.removed_ids), np.sort(expected_delta.removed_ids))
    delta.removed_ids = np.sort(delta.removed_ids)
    expected_delta.removed_ids = np.sort(expected_delta.removed_ids)
    assert_same_state(delta, expected_delta)
    assert delta.ids.shape[0] < tiered.num_rows  # a delta, not everything
    # restore into a fresh tiered table and into an in-memory one: both equal the original
    (tmp_path / "b").mkdir()
    _, restored = pair(tmp_path / "b", memory_rows=16)
    plain = EmbeddingTable("t", DIM, optimizer=OPTIMIZERS["adagrad"], stochastic_rounding=False, seed=3)
    assert full is not None
    for table in (restored, plain):
        table.import_state(full)
        table.apply_delta(delta)
        assert_same_state(table.export_state(), tiered.export_state())
    assert restored.memory_tier_rows <= 16 and restored.disk_tier_rows > 0
    # and the restored tiered table trains on exactly like the original
    for step, ids, grads in zipf_batches(5, seed=9):
        for table in (tiered, restored):
            table.pull(ids)
            table.push(ids, grads, step=30 + step)
    assert_same_state(restored.export_state(), tiered.export_state())


def test_delta_holds_cold_rows_changed_since_marker(tmp_path):
    oracle, tiered = pair(tmp_path, memory_rows=4)
    ids = np.arange(20, dtype=np.int64)
    grads = np.ones((20, DIM), dtype=np.float32)
    for table in (oracle, tiered):
        table.pull(ids)
        table.push(ids, grads, step=1)
    marker = tiered.delta_marker()
    changed = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)  # more than fit in memory
    for table in (oracle, tiered):
        table.pull(changed)
        table.push(changed, np.ones((9, DIM), dtype=np.float32), step=2)
    # touch other rows at step 2 without changing them: they move between tiers only
    tiered.pull(np.arange(10, 20, dtype=np.int64), train=False)
    delta = tiered.export_delta(marker)
    assert tiered.disk_tier_rows > 0
    assert set(delta.ids.tolist()) == set(oracle.export_delta(marker).ids.tolist())
    assert set(changed.tolist()) <= set(delta.ids.tolist())


@pytest.mark.parametrize("eviction", [EvictionSpec(ttl_steps=3), EvictionSpec(max_rows=30)])
def test_eviction_spans_both_tiers(tmp_path, eviction):
    oracle, tiered = pair(tmp_path, memory_rows=12, eviction=eviction)
    for step, ids, grads in zipf_batches(20):
        for table in (oracle, tiered):
            table.pull(ids)
            table.push(ids, grads, step=step)
        if step % 5 == 0:
            assert tiered.evict(step=step) == oracle.evict(step=step)
            assert tiered.num_rows == oracle.num_rows
    assert_same_state(tiered.export_state(), oracle.export_state())


@pytest.mark.parametrize(
    "admission",
    [
        AdmissionSpec("min_count", min_count=3, sketch_width=256),
        AdmissionSpec("probability", probability=0.4),
    ],
)
def test_admission_matches(tmp_path, admission):
    oracle, tiered = pair(tmp_path, memory_rows=10, admission=admission)
    train_both(oracle, tiered, 30)
    assert oracle.num_rows > 10
    assert_same_state(tiered.export_state(), oracle.export_state())


def test_build_table_from_spec(tmp_path):
    spec = TableSpec(
        "t", 4, optimizer=OPTIMIZERS["sgd"], storage=StorageSpec(memory_rows=3, disk_dir=str(tmp_path))
    )
    table = build_table(spec)
    assert isinstance(table, TieredTable) and table.memory_rows == 3
    with pytest.raises(ValueError, match="build_table"):  # the in-memory class builds no disk tier
        EmbeddingTable.from_spec(spec)
    reserved = build_table(
        TableSpec(
            "t", 4, optimizer=OPTIMIZERS["sgd"], initial_rows=100,
            storage=StorageSpec(memory_rows=50, disk_dir=str(tmp_path)),
        )
    )  # fmt: skip
    assert isinstance(reserved, TieredTable) and reserved.memory_bytes()["payload"] >= 50 * 4 * 4
    plain = build_table(TableSpec("t", 4, optimizer=OPTIMIZERS["sgd"]))
    assert type(plain) is EmbeddingTable


def test_non_lazy_optimizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lazy"):
        TieredTable(
            "t", 4, memory_rows=3, disk_dir=str(tmp_path), optimizer=SparseOptimizerSpec("sgd", lazy=False)
        )


def test_stats_count_the_traffic(tmp_path):
    _, tiered = pair(tmp_path, memory_rows=8)
    for step, ids, grads in zipf_batches(10):
        tiered.pull(ids)
        tiered.push(ids, grads, step=step)
    stats = tiered.tier_stats()
    assert stats["memory_rows"] + stats["disk_rows"] == tiered.num_rows
    assert stats["pull_hits"] + stats["pull_misses"] == 10 * 48
    record = tiered._cold.layout.record_bytes
    assert stats["disk_bytes_written"] == (stats["demotions"] + stats["relocations"]) * record
    assert stats["disk_bytes_read"] >= stats["promotions"] * record
    assert stats["prefetch_hits"] == 0  # nothing prefetched
    assert tiered.memory_bytes()["disk_index"] > 0


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_disk_record_size_is_planned(precision, optimizer):
    layout = RecordLayout(DIM, precision=precision, optimizer=optimizer)
    assert disk_bytes_per_row(DIM, precision=precision, optimizer=optimizer) == layout.record_bytes


def test_memory_budget_holds_both_indexes(tmp_path):
    """memory_rows_for_budget leaves room for the disk tier's index: a table filled to the expected
    rows stays within the budget (measured by the table's own byte count)."""
    budget, expected = 1_000_000, 20_000
    memory_rows = memory_rows_for_budget(
        budget, dim=DIM, precision="fp32", optimizer="adagrad", expected_rows=expected
    )
    assert 0 < memory_rows < expected
    table = TieredTable(
        "t", DIM, memory_rows=memory_rows, disk_dir=str(tmp_path), optimizer=OPTIMIZERS["adagrad"]
    )
    ids = np.arange(expected, dtype=np.int64)
    for start in range(0, expected, 1000):
        chunk = ids[start : start + 1000]
        table.pull(chunk)
        table.push(chunk, np.ones((chunk.shape[0], DIM), dtype=np.float32), step=1 + start // 1000)
    assert table.num_rows == expected and table.memory_tier_rows <= memory_rows
    assert table.memory_bytes()["total"] - table.memory_bytes()["admission"] <= budget
    with pytest.raises(ValueError, match="cannot hold the disk tier's index of 100000000 rows"):
        memory_rows_for_budget(budget, dim=DIM, precision="fp32", optimizer="sgd", expected_rows=10**8)


def test_sampled_rows_are_live_unexcluded_and_uniform():
    """sample_rows against the index's own live rows: every row drawn is live, not excluded, drawn
    once; over many draws each live row comes up about equally often."""
    from psrec.embedding.hash_index import HashIndex
    from psrec.embedding.tier_policy import sample_rows

    index = HashIndex()
    index.insert(np.arange(0, 4000, dtype=np.int64) * 13)
    index.remove(np.arange(0, 4000, 2, dtype=np.int64) * 13)  # half the rows freed
    live = index.live_rows(sort=True)
    excluded = np.zeros(index.row_capacity, dtype=np.bool_)
    excluded[live[:100]] = True
    rng = np.random.default_rng(0)
    hits = np.zeros(index.row_capacity, dtype=np.int64)
    for _ in range(400):
        rows = sample_rows(index.tags, index.slots, 200, rng, excluded=excluded)
        assert np.all(np.diff(rows) > 0) and np.isin(rows, live).all() and not excluded[rows].any()
        hits[rows] += 1
    drawn = hits[live[100:]]
    assert abs(drawn.mean() - 400 * 200 / live.shape[0]) < 0.25 * drawn.mean()
    assert drawn.min() > 0.4 * drawn.mean() and drawn.max() < 1.8 * drawn.mean()


def test_sampled_victims_keep_the_exact_policys_hit_rate(tmp_path):
    """The hit rate with sampled victims (8 candidates a row) against ranking every memory row, on
    the same Zipf batches; the rows stay those of the in-memory table either way."""
    rates = {}
    for sample in (0, 8):
        directory = tmp_path / str(sample)
        directory.mkdir()
        oracle, _ = pair(directory, memory_rows=200)
        table = TieredTable(
            "t", DIM, memory_rows=200, disk_dir=str(directory), victim_sample=sample,
            optimizer=OPTIMIZERS["adagrad"], seed=3,
        )  # fmt: skip
        for step, ids, grads in zipf_batches(120, batch=400, universe=4000):
            for each in (oracle, table):
                each.pull(ids)
                each.push(ids, grads, step=step)
        assert_same_state(oracle.export_state(), table.export_state())
        rates[sample] = table.hits / (table.hits + table.misses)
        assert table.demotions > 1000
    assert abs(rates[8] - rates[0]) < 0.02, rates


def test_the_config_reads_ahead_from_the_tables_default_row_count() -> None:
    from psrec.config_embedding import StorageConfig
    from psrec.embedding.specs import PREFETCH_MIN_ROWS

    assert StorageConfig(memory_rows=1, disk_dir="d").prefetch_min_rows == PREFETCH_MIN_ROWS
