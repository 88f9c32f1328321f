"""Property-based test: random sequences of pulls, pushes, removals, evictions, full and delta
checkpoints on a TieredTable with a tiny memory budget, against an in-memory EmbeddingTable given the
same operations (the oracle): every pulled row and every exported state equal to the bit."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from psrec.embedding import AdmissionSpec, EmbeddingTable, EvictionSpec, SparseOptimizerSpec, TieredTable

DIM = 4
INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
KEY_POOL = [INT64_MIN, INT64_MAX, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -7, 1 << 40, 12345]
KEY_LISTS = st.lists(st.sampled_from(KEY_POOL), min_size=0, max_size=20)
OPTIMIZERS = [
    SparseOptimizerSpec("sgd", lr=0.1),
    SparseOptimizerSpec("adagrad", lr=0.1),
    SparseOptimizerSpec("rowwise_adagrad", lr=0.1),
    SparseOptimizerSpec("adam", lr=0.01),
    SparseOptimizerSpec("ftrl", lr=0.1, ftrl_l1=0.1, ftrl_l2=0.01),
]


def same_bits(left: np.ndarray, right: np.ndarray) -> bool:
    return left.dtype == right.dtype and left.shape == right.shape and left.tobytes() == right.tobytes()


def same_state(left, right) -> bool:
    left_arrays, right_arrays = left.to_arrays(), right.to_arrays()
    if sorted(left_arrays) != sorted(right_arrays):
        return False
    return all(key == "config" or same_bits(left_arrays[key], right_arrays[key]) for key in left_arrays)


class TieredMachine(RuleBasedStateMachine):
    @initialize(
        optimizer=st.sampled_from(OPTIMIZERS),
        precision=st.sampled_from(["fp32", "fp16", "int8"]),
        memory_rows=st.integers(1, 6),
        policy=st.sampled_from(["lfu", "lru", "lfu_aging"]),
        admission=st.sampled_from(
            [AdmissionSpec(), AdmissionSpec("min_count", min_count=2, sketch_width=64)]
        ),
        eviction=st.sampled_from([EvictionSpec(), EvictionSpec(ttl_steps=3), EvictionSpec(max_rows=5)]),
    )
    def setup(self, optimizer, precision, memory_rows, policy, admission, eviction) -> None:
        self.directory = tempfile.mkdtemp(prefix="psrec-tiered-test-")
        self.arguments = dict(
            optimizer=optimizer,
            precision=precision,
            stochastic_rounding=precision != "fp32",
            admission=admission,
            eviction=eviction,
            seed=5,
        )
        self.tiered_arguments = dict(memory_rows=memory_rows, disk_dir=self.directory, policy=policy)
        self.oracle = EmbeddingTable("t", DIM, **self.arguments)
        self.tiered = TieredTable("t", DIM, **self.tiered_arguments, **self.arguments)
        self.step = 0
        self.full = None
        self.deltas: list = []
        self.marker = None

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(keys=KEY_LISTS, train=st.booleans())
    def pull(self, keys, train) -> None:
        ids = np.array(keys, dtype=np.int64)
        assert same_bits(self.tiered.pull(ids, train=train), self.oracle.pull(ids, train=train))

    @rule(keys=KEY_LISTS, seed=st.integers(0, 2**16), pulled=st.booleans())
    def push(self, keys, seed, pulled) -> None:
        ids = np.array(keys, dtype=np.int64)
        if pulled:
            assert same_bits(self.tiered.pull(ids), self.oracle.pull(ids))
        grads = np.random.default_rng(seed).standard_normal((ids.shape[0], DIM)).astype(np.float32)
        self.step += 1
        self.oracle.push(ids, grads, step=self.step)
        self.tiered.push(ids, grads, step=self.step)

    @rule(keys=KEY_LISTS)
    def prefetch(self, keys) -> None:
        """Read ahead on the tiered table only: whatever happens to those rows before the next pull
        (promoted, updated, demoted to a reused segment, removed, restored), results stay the
        oracle's."""
        self.tiered.prefetch(np.unique(np.array(keys, dtype=np.int64)))

    @rule(keys=KEY_LISTS)
    def remove(self, keys) -> None:
        ids = np.unique(np.array(keys, dtype=np.int64))
        assert self.tiered.remove(ids) == self.oracle.remove(ids)

    @rule()
    def evict(self) -> None:
        assert self.tiered.evict(step=self.step) == self.oracle.evict(step=self.step)

    @rule()
    def checkpoint_full(self) -> None:
        self.full = (self.tiered.export_state(), self.oracle.export_state())
        assert same_state(*self.full)
        self.marker = (self.tiered.delta_marker(), self.oracle.delta_marker())
        self.deltas = []

    @precondition(lambda self: self.marker is not None)
    @rule()
    def checkpoint_delta(self) -> None:
        deltas = (self.tiered.export_delta(self.marker[0]), self.oracle.export_delta(self.marker[1]))
        self.marker = (self.tiered.delta_marker(), self.oracle.delta_marker())
        self.deltas.append(deltas)

    @precondition(lambda self: self.full is not None)
    @rule(into_memory_table=st.booleans())
    def restore(self, into_memory_table) -> None:
        """Roll both tables back to their own last checkpoint chain, as a restarted shard would; the
        tiered chain may also be restored into an in-memory table (and must give the same rows)."""
        tiered = TieredTable("t", DIM, **self.tiered_arguments, **self.arguments)
        oracle = EmbeddingTable("t", DIM, **self.arguments)
        plain = EmbeddingTable("t", DIM, **self.arguments)
        for index, table in enumerate((tiered, oracle)):
            table.import_state(self.full[index])
            for pair in self.deltas:
                table.apply_delta(pair[index])
        assert same_state(tiered.export_state(), oracle.export_state())
        if into_memory_table:
            plain.import_state(self.full[0])
            for pair in self.deltas:
                plain.apply_delta(pair[0])
            assert same_state(plain.export_state(), oracle.export_state())
        self.tiered.close()
        self.tiered, self.oracle = tiered, oracle
        self.step = max(self.step, int(self.full[1].config["clock"]))
        self.checkpoint_full()

    @invariant()
    def same_contents(self) -> None:
        if not hasattr(self, "tiered"):
            return
        assert self.tiered.num_rows == self.oracle.num_rows
        if self.marker is not None:  # the delta a checkpoint would take now holds the same rows
            delta = self.tiered.export_delta(self.marker[0])
            expected = self.oracle.export_delta(self.marker[1])
            assert same_bits(np.sort(delta.removed_ids), np.sort(expected.removed_ids))
            delta.removed_ids = expected.removed_ids
            assert same_state(delta, expected)
        assert self.tiered.memory_tier_rows <= max(self.tiered.memory_rows, 20)


TieredMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_table_machine = TieredMachine.TestCase
