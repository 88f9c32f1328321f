"""Property-based test: random operation sequences on EmbeddingTable against the dict + NumPy
``ReferenceTable`` (insert/lookup/update/remove/evict/export/import/delta), with int64 extremes,
negative ids and heavy duplicates, for every optimizer and precision."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from psrec.embedding import (
    AdmissionSpec,
    EmbeddingTable,
    EvictionSpec,
    SparseOptimizerSpec,
    TableDelta,
    TableState,
)
from psrec.testing.embedding_reference import ReferenceTable

DIM = 4
INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
KEY_POOL = [INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, -1, 0, 1, 2, -7, 1 << 40, -(1 << 40), 12345]
KEYS = st.one_of(st.sampled_from(KEY_POOL), st.integers(INT64_MIN, INT64_MAX))
KEY_LISTS = st.lists(KEYS, min_size=0, max_size=12).flatmap(
    lambda keys: (
        st.just(keys) if not keys else st.lists(st.sampled_from(keys), min_size=len(keys), max_size=24)
    )
)
TOLERANCE = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 2e-3), "int8": (0.0, 6e-2)}
OPTIMIZERS = [
    SparseOptimizerSpec("sgd", lr=0.1),
    SparseOptimizerSpec("adagrad", lr=0.1),
    SparseOptimizerSpec("rowwise_adagrad", lr=0.1),
    SparseOptimizerSpec("adam", lr=0.01),
    SparseOptimizerSpec("ftrl", lr=0.1, ftrl_l1=0.1, ftrl_l2=0.01),
]


class TableMachine(RuleBasedStateMachine):
    @initialize(
        optimizer=st.sampled_from(OPTIMIZERS),
        precision=st.sampled_from(["fp32", "fp32", "fp16", "int8"]),
        min_count=st.sampled_from([1, 1, 2]),
        eviction=st.sampled_from(
            [
                EvictionSpec(),
                EvictionSpec(ttl_steps=3),
                EvictionSpec(max_rows=3),
                EvictionSpec(ttl_steps=2, max_rows=4),
            ]
        ),
    )
    def setup(self, optimizer, precision, min_count, eviction) -> None:
        admission = (
            AdmissionSpec("min_count", min_count=min_count, sketch_width=1 << 16)
            if min_count > 1
            else AdmissionSpec()
        )
        self.options = dict(
            optimizer=optimizer, precision=precision, admission=admission, eviction=eviction, seed=5
        )
        self.table = EmbeddingTable("prop", DIM, **self.options)
        self.reference = ReferenceTable(
            DIM, optimizer, precision=precision, admission=admission, eviction=eviction, seed=5
        )
        self.rtol, self.atol = TOLERANCE[precision]
        self.step = 0
        self.replica: EmbeddingTable | None = None
        self.marker = 0

    def _compare(self, actual: np.ndarray, expected: np.ndarray) -> None:
        np.testing.assert_allclose(actual, expected, rtol=self.rtol, atol=self.atol)

    @rule(keys=KEY_LISTS, train=st.booleans())
    def pull(self, keys, train) -> None:
        ids = np.array(keys, dtype=np.int64)
        self._compare(self.table.pull(ids, train=train), self.reference.pull(ids, train=train))

    @rule(keys=KEY_LISTS, seed=st.integers(0, 2**16), advance=st.integers(0, 2))
    def push(self, keys, seed, advance) -> None:
        ids = np.array(keys, dtype=np.int64)
        grads = np.random.default_rng(seed).normal(size=(ids.size, DIM)).astype(np.float32)
        self.step += advance
        self.table.push(ids, grads, step=self.step)
        self.reference.push(ids, grads, step=self.step)

    @rule(keys=KEY_LISTS)
    def remove(self, keys) -> None:
        ids = np.array(keys, dtype=np.int64)
        assert self.table.remove(ids) == self.reference.remove(ids)

    @rule(later=st.integers(0, 5))
    def evict(self, later) -> None:
        assert self.table.evict(step=self.step + later) == self.reference.evict(step=self.step + later)

    @rule()
    def export_import(self) -> None:
        state = TableState.from_arrays(self.table.export_state().to_arrays())
        self.table = EmbeddingTable("prop", DIM, **self.options)
        self.table.import_state(state)
        self.replica = None

    @rule()
    def start_replica(self) -> None:
        self.replica = EmbeddingTable("replica", DIM, **self.options)
        self.replica.import_state(self.table.export_state())
        self.marker = self.table.delta_marker()

    @rule()
    def sync_replica(self) -> None:
        if self.replica is None:
            return
        delta = TableDelta.from_arrays(self.table.export_delta(self.marker).to_arrays())
        self.marker = self.table.delta_marker()
        self.replica.apply_delta(delta)
        expected, actual = self.table.export_state(), self.replica.export_state()
        np.testing.assert_array_equal(actual.ids, expected.ids)
        np.testing.assert_array_equal(actual.rows, expected.rows)
        np.testing.assert_array_equal(actual.counts, expected.counts)
        for name, array in expected.optimizer_state.items():
            np.testing.assert_array_equal(actual.optimizer_state[name], array)

    @invariant()
    def same_rows(self) -> None:
        if not hasattr(self, "table"):
            return
        assert self.table.num_rows == len(self.reference.rows)
        state = self.table.export_state()
        assert state.ids.tolist() == sorted(self.reference.rows)
        assert state.counts.tolist() == [self.reference.rows[key].count for key in state.ids.tolist()]


TableMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_table_matches_reference = TableMachine.TestCase
