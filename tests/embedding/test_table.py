"""EmbeddingTable API: pull/push semantics, validation, state and delta export, memory accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psrec.embedding import (
    AdmissionSpec,
    EmbeddingTable,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableDelta,
    TableState,
    planned_bytes_per_row,
    warmup,
)
from psrec.embedding.initializers import initial_rows_numpy

INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
EXTREME_IDS = np.array([INT64_MIN, INT64_MAX, -1, 0, 1, INT64_MIN + 1, INT64_MAX - 1], dtype=np.int64)


def make_table(name: str = "items", dim: int = 4, **options) -> EmbeddingTable:
    options.setdefault("optimizer", SparseOptimizerSpec("rowwise_adagrad", lr=0.1))
    return EmbeddingTable(name, dim, **options)


def snapshot(table: EmbeddingTable) -> dict[str, np.ndarray]:
    arrays = table.export_state().to_arrays()
    arrays["config"] = np.array(json.dumps({**table.config(), "marker": table.delta_marker()}))
    return arrays


def assert_same_snapshot(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    assert left.keys() == right.keys()
    for key in left:
        np.testing.assert_array_equal(left[key], right[key], err_msg=key)


def test_pull_inserts_deterministic_initial_rows_for_extreme_ids() -> None:
    table = make_table()
    rows = table.pull(EXTREME_IDS)
    assert rows.dtype == np.float32 and rows.shape == (EXTREME_IDS.size, 4)
    assert table.num_rows == EXTREME_IDS.size
    np.testing.assert_allclose(rows, initial_rows_numpy(EXTREME_IDS, 4, InitializerSpec(), 0), atol=1e-6)
    other = make_table()
    reversed_rows = other.pull(EXTREME_IDS[::-1].copy())
    np.testing.assert_array_equal(reversed_rows[::-1], rows)


@pytest.mark.parametrize("populate", [True, False])
def test_reserved_rows_are_backed_with_memory_at_build_unless_told_not_to(
    populate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psrec.embedding import table as table_module

    populated: list[int] = []
    real = table_module.populate
    monkeypatch.setattr(table_module, "populate", lambda array: populated.append(array.nbytes) or real(array))
    rows = 300_000
    table = make_table(dim=16, initial_rows=rows, populate=populate)
    if not populate:
        assert populated == []
    else:  # every per-row array, the index included: payload, optimizer state, metadata, ids, slots
        assert sum(populated) >= rows * (16 * 4 + 4 + 8 + 8 + 5)
    ids = np.arange(0, 3 * rows, 3, dtype=np.int64)
    np.testing.assert_array_equal(table.pull(ids), make_table(dim=16).pull(ids))
    populated.clear()
    make_table(populate=True)  # nothing reserved: nothing to populate
    assert populated == []


def _counting_lookups(table: EmbeddingTable, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = table._index.lookup
    monkeypatch.setattr(table._index, "lookup", lambda ids: calls.append(ids.size) or real(ids))
    return calls


def test_a_push_after_its_pull_reuses_the_pulled_rows_and_updates_the_same_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = np.array([5, 9, -2, 40], dtype=np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    reference = make_table()
    monkeypatch.setattr(reference, "_pulled_rows", lambda ids: None)  # every push looked up
    reference.pull(ids.copy())
    reference.push(ids.copy(), grads, step=1)
    table = make_table()
    lookups = _counting_lookups(table, monkeypatch)
    table.pull(ids)
    table.push(ids, grads, step=1)
    assert lookups == [4]  # the pull's only
    assert_same_snapshot(snapshot(table), snapshot(reference))
    table.push(ids, grads, step=2)  # a pull is reused once
    assert lookups == [4, 4]


def test_a_push_of_equal_ids_in_another_array_reuses_the_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reuse is decided by the ids' values: a copy (as a push that crossed a process carries)
    reuses the pull; the same ids in another order, or fewer, are looked up."""
    ids = np.array([5, 9, -2, 40], dtype=np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    table = make_table()
    lookups = _counting_lookups(table, monkeypatch)
    table.pull(ids)
    table.push(ids.copy(), grads, step=1)
    assert lookups == [4]
    table.pull(ids)
    table.push(ids[::-1].copy(), grads[::-1].copy(), step=2)
    assert lookups == [4, 4, 4]
    table.pull(ids)
    table.push(ids[:3].copy(), grads[:3].copy(), step=3)
    assert lookups == [4, 4, 4, 4, 3]
    reference = make_table()  # the same calls, every push looked up
    monkeypatch.setattr(reference, "_pulled_rows", lambda ids: None)
    for step, (pushed, pushed_grads) in enumerate(
        [(ids, grads), (ids[::-1], grads[::-1]), (ids[:3], grads[:3])], start=1
    ):
        reference.pull(ids)
        reference.push(np.ascontiguousarray(pushed), np.ascontiguousarray(pushed_grads), step=step)
    assert_same_snapshot(snapshot(table), snapshot(reference))


def test_pulled_rows_are_not_reused_for_changed_ids_or_after_a_removal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = np.ones((3, 4), dtype=np.float32)
    table = make_table()
    lookups = _counting_lookups(table, monkeypatch)
    ids = np.array([1, 2, 3], dtype=np.int64)
    table.pull(ids)
    ids[0] = 7  # same array, other ids: 7 is unknown, so only 2 and 3 are updated
    before = table.pull(np.array([1, 2, 3], dtype=np.int64), train=False)
    table.push(ids, grads, step=1)
    after = table.pull(np.array([1, 2, 3], dtype=np.int64), train=False)
    np.testing.assert_array_equal(after[0], before[0])
    assert (after[1:] != before[1:]).all()
    assert table.num_rows == 3 and lookups[-1] == 3
    ids = np.array([1, 2, 3], dtype=np.int64)
    table.pull(ids)
    table.remove(np.array([2], dtype=np.int64))  # its row is free for the next new id
    count = len(lookups)
    table.push(ids, grads, step=2)
    assert len(lookups) == count + 1  # looked up again: id 2 is gone, its gradient dropped
    assert table.num_rows == 2
    evaluated = make_table()
    evaluated.pull(ids, train=False)  # evaluation pulls are not remembered
    assert evaluated._last_pull is None


def test_pull_eval_never_inserts() -> None:
    table = make_table()
    rows = table.pull(EXTREME_IDS, train=False)
    assert table.num_rows == 0
    np.testing.assert_array_equal(rows, make_table().pull(EXTREME_IDS))


def test_push_sums_duplicates_and_drops_unknown_ids() -> None:
    table = make_table(optimizer=SparseOptimizerSpec("sgd", lr=1.0))
    ids = np.array([5, 5, 9], dtype=np.int64)
    before = table.pull(ids[:2])
    grads = np.ones((3, 4), dtype=np.float32)
    table.push(ids, grads, step=7)
    after = table.pull(np.array([5, 9], dtype=np.int64), train=False)
    np.testing.assert_allclose(after[0], before[0] - 2.0, rtol=1e-6)
    assert table.num_rows == 1
    state = table.export_state()
    assert state.counts.tolist() == [2] and state.last_step.tolist() == [7]


def test_slots_freed_by_remove_are_reused() -> None:
    table = make_table()
    table.pull(np.arange(100, dtype=np.int64))
    memory = table.memory_bytes()
    assert table.remove(np.arange(0, 100, 2, dtype=np.int64)) == 50
    assert table.remove(np.array([0, 12345], dtype=np.int64)) == 0
    assert table.num_rows == 50
    table.pull(np.arange(1000, 1050, dtype=np.int64))
    assert table.num_rows == 100
    assert table.memory_bytes()["payload"] == memory["payload"]
    np.testing.assert_array_equal(
        table.pull(np.arange(1, 100, 2, dtype=np.int64), train=False),
        make_table().pull(np.arange(1, 100, 2, dtype=np.int64)),
    )


def test_growth_to_many_rows_keeps_every_row() -> None:
    table = make_table(dim=2, optimizer=SparseOptimizerSpec("sgd"))
    ids = np.random.default_rng(0).integers(INT64_MIN, INT64_MAX, size=50_000, dtype=np.int64)
    ids = np.unique(ids)
    first = table.pull(ids)
    assert table.num_rows == ids.size
    np.testing.assert_array_equal(table.pull(ids, train=False), first)
    memory = table.memory_bytes()
    assert memory["total"] == sum(value for key, value in memory.items() if key != "total")
    overhead = (memory["index"] + memory["metadata"]) / ids.size
    planned = planned_bytes_per_row(2, precision="fp32", optimizer="sgd")
    assert planned["overhead_best"] - 0.1 <= overhead <= planned["overhead_worst"] + 0.1
    assert planned["overhead_worst"] <= 24.1


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda table: table.pull(np.array([1, 2], dtype=np.int32)), TypeError, "dtype int64"),
        (lambda table: table.pull([1, 2]), TypeError, "numpy int64 array"),
        (lambda table: table.pull(np.zeros((2, 2), dtype=np.int64)), ValueError, "1-D"),
        (
            lambda table: table.push(np.array([1], np.int64), np.zeros((1, 3), np.float32), step=1),
            ValueError,
            "shape",
        ),
        (
            lambda table: table.push(np.array([1], np.int64), np.zeros((1, 4), np.float64), step=1),
            TypeError,
            "float32",
        ),
        (
            lambda table: table.push(np.array([1], np.int64), np.full((1, 4), np.inf, np.float32), step=1),
            ValueError,
            "NaN or Inf",
        ),
        (
            lambda table: table.push(np.array([1], np.int64), np.zeros((1, 4), np.float32), step=-1),
            ValueError,
            "step",
        ),
        (lambda table: table.set_learning_rate(float("nan")), ValueError, "lr"),
        (lambda table: table.evict(step=2**40), ValueError, "step"),
        (lambda table: table.remove(np.array([1.0])), TypeError, "int64"),
        (lambda table: table.export_delta(1 << 40), ValueError, "marker"),
    ],
)
def test_bad_input_raises_naming_the_table_and_changes_nothing(call, error, fragment) -> None:
    table = make_table(name="clicks")
    table.pull(np.array([1, 2], dtype=np.int64))
    table.push(np.array([1], np.int64), np.ones((1, 4), np.float32), step=1)
    before = snapshot(table)
    with pytest.raises(error, match=f"table 'clicks'.*{fragment}"):
        call(table)
    assert_same_snapshot(snapshot(table), before)


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"dim": 0}, "dim"),
        ({"precision": "bf16"}, "precision"),
        ({"optimizer": "adagrad"}, "SparseOptimizerSpec"),
    ],
)
def test_bad_construction_names_the_table(arguments, fragment) -> None:
    options = {"dim": 4, "optimizer": SparseOptimizerSpec("sgd")} | arguments
    with pytest.raises((ValueError, TypeError), match=f"table 'bad'.*{fragment}"):
        EmbeddingTable("bad", options.pop("dim"), **options)


@pytest.mark.parametrize(
    ("factory", "fragment"),
    [
        (lambda: SparseOptimizerSpec("lamb"), "optimizer name"),
        (lambda: InitializerSpec("xavier"), "initializer kind"),
        (lambda: AdmissionSpec("bloom"), "admission kind"),
        (lambda: SparseOptimizerSpec("ftrl", weight_decay=0.1), "weight_decay"),
    ],
)
def test_unknown_names_are_rejected_by_the_specs(factory, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        factory()


def _trained_table(**options) -> EmbeddingTable:
    table = make_table(**options)
    generator = np.random.default_rng(0)
    for step in range(1, 4):
        ids = generator.integers(-20, 20, size=30).astype(np.int64)
        table.pull(ids)
        table.push(ids, generator.normal(size=(30, 4)).astype(np.float32), step=step)
    return table


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam", "ftrl"])
def test_export_import_round_trip_through_npz(tmp_path, precision, optimizer) -> None:
    options = {"precision": precision, "optimizer": SparseOptimizerSpec(optimizer, lr=0.1)}
    table = _trained_table(**options, admission=AdmissionSpec("min_count", min_count=2, sketch_width=256))
    table.set_learning_rate(0.05)
    path = tmp_path / "state.npz"
    np.savez(path, **table.export_state().to_arrays())
    with np.load(path, allow_pickle=False) as loaded:
        state = TableState.from_arrays(dict(loaded))
    restored = make_table(**options, admission=AdmissionSpec("min_count", min_count=2, sketch_width=256))
    restored.import_state(state)
    assert restored.optimizer.lr == 0.05
    ids = np.arange(-25, 25, dtype=np.int64)
    np.testing.assert_array_equal(restored.pull(ids, train=False), table.pull(ids, train=False))
    grads = np.ones((ids.size, 4), dtype=np.float32)
    for each in (table, restored):
        each.pull(ids)
        each.push(ids, grads, step=10)
    np.testing.assert_array_equal(restored.pull(ids, train=False), table.pull(ids, train=False))


def test_import_rejects_incompatible_state_and_keeps_contents() -> None:
    table = _trained_table()
    state = table.export_state()
    other = make_table(dim=8)
    other.pull(np.array([1], dtype=np.int64))
    before = snapshot(other)
    with pytest.raises(ValueError, match="table 'items'.*dim=4"):
        other.import_state(state)
    with pytest.raises(ValueError, match="optimizer 'rowwise_adagrad'"):
        make_table(optimizer=SparseOptimizerSpec("adam")).import_state(state)
    broken = TableState.from_arrays(state.to_arrays())
    broken.counts = broken.counts[:-1]
    with pytest.raises(ValueError, match="counts"):
        other_same = make_table()
        other_same.import_state(broken)
    assert_same_snapshot(snapshot(other), before)


def test_import_rejects_a_state_with_a_repeated_id_and_keeps_contents() -> None:
    table = _trained_table()
    arrays = table.export_state().to_arrays()
    arrays["ids"] = arrays["ids"].copy()
    arrays["ids"][-1] = arrays["ids"][0]
    same = make_table()
    same.pull(np.array([1, 2], dtype=np.int64))
    before = snapshot(same)
    with pytest.raises(ValueError, match="state ids contain duplicates"):
        same.import_state(TableState.from_arrays(arrays))
    assert_same_snapshot(snapshot(same), before)


def test_delta_holds_changed_and_removed_rows_and_replays_onto_a_copy() -> None:
    table = _trained_table()
    replica = make_table()
    replica.import_state(table.export_state())
    marker = table.delta_marker()
    ids = np.array([-3, 0, 99, 100], dtype=np.int64)
    table.pull(ids)
    table.push(ids, np.full((4, 4), 0.5, np.float32), step=5)
    table.remove(np.array([-20, -19, 99], dtype=np.int64))
    delta = table.export_delta(marker)
    assert set(delta.ids.tolist()) >= {-3, 0, 100}
    assert 99 not in delta.ids.tolist()
    assert set(delta.removed_ids.tolist()) <= {-20, -19, 99} and 99 in delta.removed_ids.tolist()
    assert delta.ids.size < table.num_rows
    delta = TableDelta.from_arrays(delta.to_arrays())
    replica.apply_delta(delta)
    state, replica_state = table.export_state(), replica.export_state()
    np.testing.assert_array_equal(replica_state.ids, state.ids)
    np.testing.assert_array_equal(replica_state.rows, state.rows)
    np.testing.assert_array_equal(
        replica_state.optimizer_state["accumulator"], state.optimizer_state["accumulator"]
    )
    assert table.export_delta(table.delta_marker()).ids.size <= 4
    assert table.delta_marker() > marker


def test_markers_from_before_an_import_are_refused() -> None:
    table = _trained_table()
    marker = table.delta_marker()
    table.import_state(table.export_state())
    assert table.delta_marker() > marker
    with pytest.raises(ValueError, match="generation"):
        table.export_delta(marker)


def test_memory_bytes_has_every_component() -> None:
    table = make_table(admission=AdmissionSpec("min_count", min_count=2, sketch_width=1024, sketch_depth=2))
    table.pull(np.arange(10, dtype=np.int64))
    memory = table.memory_bytes()
    assert set(memory) == {"payload", "optimizer", "index", "metadata", "admission", "total"}
    assert memory["admission"] == 1024 * 2 * 4
    assert memory["total"] == sum(value for key, value in memory.items() if key != "total")


def test_eviction_spec_is_applied_on_evict() -> None:
    table = make_table(eviction=EvictionSpec(ttl_steps=5))
    table.pull(np.arange(4, dtype=np.int64))
    table.push(np.array([0], np.int64), np.ones((1, 4), np.float32), step=10)
    assert table.evict(step=12) == 3  # rows 1..3 were inserted at clock 0
    assert table.evict(step=15) == 0
    assert table.num_rows == 1
    assert table.evict(step=16) == 1


def test_forgetting_removal_records_refuses_older_markers() -> None:
    table = _trained_table()
    old = table.delta_marker()
    table.remove(np.array([0, 1], dtype=np.int64))
    table.push(np.array([2], np.int64), np.ones((1, 4), np.float32), step=9)
    recent = table.delta_marker()
    table.remove(np.array([3], dtype=np.int64))
    table.forget_deltas_before(recent)
    assert table.export_delta(recent).removed_ids.tolist() == [3]
    with pytest.raises(ValueError, match="older than the removal records kept"):
        table.export_delta(old)


def test_warmup_runs_every_kernel() -> None:
    assert warmup() >= 0.0


@pytest.mark.parametrize(
    "admission",
    [
        AdmissionSpec("min_count", min_count=2, sketch_width=256),
        AdmissionSpec("probability", probability=0.4),
    ],
    ids=["min_count", "probability"],
)
def test_a_full_plus_delta_restore_admits_like_the_original(admission: AdmissionSpec) -> None:
    """The admission state (min_count sketch, probability pull counter) travels in deltas too: a table
    restored from full + delta admits the same ids as the undisturbed table afterwards."""
    table = make_table(admission=admission, seed=3)
    table.pull(np.arange(0, 50, dtype=np.int64))
    full = table.export_state()
    marker = table.delta_marker()
    table.pull(np.arange(40, 120, dtype=np.int64))  # seen once more (sketch) / one more pull (counter)
    table.push(np.arange(0, 10, dtype=np.int64), np.ones((10, 4), np.float32), step=1)
    delta = TableDelta.from_arrays(table.export_delta(marker).to_arrays())
    restored = make_table(admission=admission, seed=3)
    restored.import_state(TableState.from_arrays(full.to_arrays()))
    restored.apply_delta(delta)
    later = np.arange(60, 260, dtype=np.int64)
    table.pull(later)
    restored.pull(later)
    assert_same_snapshot(restored.export_state().to_arrays(), table.export_state().to_arrays())
