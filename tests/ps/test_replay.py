"""A shard rebuilt from its checkpoint file and its log equals the same shard never lost.

The oracle is a plain `ParameterShard` that receives the same operations and is never rebuilt. The
logged shard is dropped at various points (between checkpoints, mid sync step, after a torn record,
twice in a row) and opened again on its log directory; every table's rows, optimizer state, counts,
clocks, admission sketch, config, request ids and snapshots must then equal the oracle's exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec import checkpoint
from psrec.checkpoint.policy import checkpoint_chain
from psrec.embedding import AdmissionSpec, EmbeddingTable, InitializerSpec, SparseOptimizerSpec, TableSpec
from psrec.ps import bucket_move
from psrec.ps.push_log import PushLog, PushLogError, read_segment, segment_paths
from psrec.ps.replay import LoggedShard, prepare_fresh
from psrec.ps.shard import ParameterShard
from psrec.ps.shard_checkpoint import write_shard_checkpoint
from psrec.ps.wire import decode_gradients, encode_gradients

DIM = 4
SPECS = [
    TableSpec(
        "t",
        DIM,
        SparseOptimizerSpec("adam", lr=0.05),
        initializer=InitializerSpec("uniform", scale=0.1),
        admission=AdmissionSpec("min_count", min_count=2, sketch_width=257, sketch_depth=2),
    ),
    TableSpec("u", DIM, SparseOptimizerSpec("rowwise_adagrad", lr=0.1), seed=3),
]


def new_shard(num_trainers: int = 1) -> ParameterShard:
    return ParameterShard(
        0, {spec.name: EmbeddingTable.from_spec(spec) for spec in SPECS}, num_trainers=num_trainers
    )


def state_of(shard: ParameterShard) -> dict[str, Any]:
    """Everything a table holds, per-row arrays in id order (slot order may differ after a restore)."""
    out: dict[str, Any] = {
        "last_request": {t: shard.last_request.get(t, -1) for t in range(shard.num_trainers)},
        "applied_step": shard.applied_step,
        "snapshots": shard.snapshot_tags(),
    }
    for name, table in shard.tables.items():
        arrays = table.export_state().to_arrays()
        order = np.argsort(arrays["ids"])
        for key, value in arrays.items():
            per_row = value.ndim >= 1 and value.shape[0] == order.shape[0] and key != "admission_sketch"
            out[f"{name}/{key}"] = value[order] if per_row else value
        out[f"{name}/lr"] = table.optimizer.lr
    return out


def assert_same(a: ParameterShard, b: ParameterShard) -> None:
    left, right = state_of(a), state_of(b)
    assert left.keys() == right.keys()
    for key in left:
        if isinstance(left[key], np.ndarray):
            np.testing.assert_array_equal(left[key], right[key], err_msg=key)
        else:
            assert left[key] == right[key], key


class Twin:
    """The same operations on an oracle shard and on a logged shard (which may be rebuilt)."""

    def __init__(self, tmp_path: Path, *, num_trainers: int = 1, wire: str = "fp32") -> None:
        self.run_dir = tmp_path / "run"
        self.log_dir = tmp_path / "log"
        self.num_trainers = num_trainers
        self.started_with = num_trainers  # a restarted process is built as the first one was
        self.wire = wire
        self.oracle = new_shard(num_trainers)
        prepare_fresh(self.log_dir)
        self.logged = LoggedShard.open(new_shard(num_trainers), self.log_dir)
        self.rng = np.random.default_rng(0)
        self.last: checkpoint.CheckpointRef | None = None
        self.pulls = 0

    def rebuild(self) -> LoggedShard:
        """The shard's process died: a new one opens the same log."""
        self.logged.log.close()
        self.logged = LoggedShard.open(new_shard(self.started_with), self.log_dir)
        return self.logged

    def pull(self, ids_t: np.ndarray, ids_u: np.ndarray) -> None:
        self.pulls += 1
        requests = {"t": ids_t, "u": ids_u}
        expected = self.oracle.pull(requests)
        got = self.logged.pull(requests, train=True, caller="c", request=self.pulls)
        for name in requests:
            np.testing.assert_array_equal(got[name], expected[name])

    def push(self, trainer: int, step: int, ids_t: np.ndarray, ids_u: np.ndarray) -> None:
        wire = {
            name: (ids, encode_gradients(self.rng.normal(size=(ids.size, DIM)).astype(np.float32), self.wire))
            for name, ids in (("t", ids_t), ("u", ids_u))
        }
        decoded = {name: (ids, decode_gradients(grads)) for name, (ids, grads) in wire.items()}
        self.oracle.push(trainer, step, step, decoded)  # type: ignore[arg-type]
        self.logged.push(trainer, step, step, wire)

    def step(self, step: int) -> None:
        ids_t = np.unique(self.rng.integers(0, 40, size=12))
        ids_u = np.unique(self.rng.integers(0, 1000, size=8))
        self.pull(ids_t, ids_u)
        for trainer in range(self.num_trainers):
            self.push(trainer, step, ids_t, ids_u)

    def call(self, method: str, *args: Any) -> None:
        getattr(self.oracle, method)(*args)
        self.logged.call(method, *args)

    def checkpoint(self, step: int, kind: str) -> None:
        """What the runtime does: the logged shard writes its file, commit, confirm, new log segment."""
        pending = checkpoint.begin_checkpoint(self.run_dir, step=step, kind=kind)  # type: ignore[arg-type]
        record = write_shard_checkpoint(self.logged.shard, pending, kind)
        ref = checkpoint.commit_checkpoint(
            pending,
            shard_files={0: record},
            dense={},
            trainers=[],
            extra={},
            config={},
            bucket_map=[0],
            parent=self.last if kind == "delta" else None,
        )
        self.oracle.checkpoint_arrays(kind)
        self.call("confirm_checkpoint")
        chain = checkpoint_chain(ref, checkpoint.list_checkpoints(self.run_dir))
        assert isinstance(chain, list)
        self.logged.checkpointed(chain)
        self.last = ref


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_a_shard_rebuilt_between_checkpoints_equals_the_one_never_lost(tmp_path: Path, wire: str) -> None:
    twin = Twin(tmp_path, wire=wire)
    for step in range(3):
        twin.step(step)
    twin.call("save_snapshot", "best")  # older than the next checkpoint: kept in a file
    twin.checkpoint(3, "full")
    for step in range(3, 6):
        twin.step(step)
    twin.checkpoint(6, "delta")
    twin.call("set_learning_rate", 0.02, ["t"])
    for step in range(6, 9):
        twin.step(step)
    twin.call("evict", 8)
    rebuilt = twin.rebuild()
    assert rebuilt.recovery is not None
    assert rebuilt.recovery["base_step"] == 6 and rebuilt.recovery["pushes_replayed"] == 3
    assert_same(rebuilt.shard, twin.oracle)
    # It goes on logging: train, rebuild again, a delta checkpoint, and the old snapshot comes back.
    for step in range(9, 11):
        twin.step(step)
    assert_same(twin.rebuild().shard, twin.oracle)
    snapshot_file = twin.log_dir / "snapshot-best.npz"
    written = snapshot_file.stat().st_mtime_ns
    twin.checkpoint(11, "delta")
    assert snapshot_file.stat().st_mtime_ns == written  # unchanged since: not written again
    twin.step(11)
    twin.call("restore_snapshot", "best")
    assert_same(twin.rebuild().shard, twin.oracle)
    twin.call("save_snapshot", "best")  # a newer snapshot: its file is written at the next checkpoint
    twin.step(12)
    twin.checkpoint(13, "full")  # after a restored snapshot a full one is due
    assert snapshot_file.stat().st_mtime_ns != written
    twin.step(13)
    twin.call("restore_snapshot", "best")
    assert_same(twin.rebuild().shard, twin.oracle)


def test_bucket_moves_are_replayed_and_a_repeated_import_adds_nothing(tmp_path: Path) -> None:
    """Rows imported from another shard and buckets dropped (a resharding) are in the log: the
    rebuilt shard has them, an import sent again after a failure adds nothing, and the full
    checkpoint that follows a move starts a log that rebuilds the shard too."""
    num_buckets = 8
    other = ParameterShard(1, {spec.name: EmbeddingTable.from_spec(spec) for spec in SPECS})
    for _ in range(2):  # twice: the min_count table admits the ids
        other.pull({"t": np.arange(2000, 2040), "u": np.arange(3000, 3030)})
    other.push(0, 0, 0, {"u": (np.arange(3000, 3030), np.ones((30, DIM), np.float32))})
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    for step in range(3):
        twin.step(step)
    rows = bucket_move.bucket_rows(other, [1, 3], num_buckets)
    added = bucket_move.add_bucket_rows(twin.oracle, rows, num_buckets=num_buckets)
    assert added > 0
    assert twin.logged.import_buckets(rows, num_buckets=num_buckets, move="m1") == added
    assert twin.logged.import_buckets(rows, num_buckets=num_buckets, move="m1") == added  # a repeat
    bucket_move.drop_buckets(twin.oracle, [2], num_buckets)
    twin.logged.drop_buckets([2], num_buckets=num_buckets)
    twin.step(3)
    assert_same(twin.rebuild().shard, twin.oracle)
    assert twin.logged.shard.needs_full_checkpoint
    twin.logged.shard.needs_full_checkpoint = False  # the rebuilt shard knows a full checkpoint is due
    assert twin.rebuild().shard.needs_full_checkpoint
    twin.checkpoint(4, "full")
    twin.step(4)
    assert_same(twin.rebuild().shard, twin.oracle)


def test_a_changed_trainer_count_is_replayed_and_kept_across_checkpoints(tmp_path: Path) -> None:
    """Trainers removed while training (`set_num_trainers`): the rebuilt shard, built with the count
    it started with, completes steps with the new count, before and after the next checkpoint."""
    twin = Twin(tmp_path, num_trainers=2)
    twin.checkpoint(0, "full")
    twin.step(0)
    twin.call("set_num_trainers", 1)
    twin.num_trainers = 1
    twin.step(1)
    rebuilt = twin.rebuild()
    assert rebuilt.shard.num_trainers == 1
    assert_same(rebuilt.shard, twin.oracle)
    twin.checkpoint(2, "delta")
    twin.step(2)
    rebuilt = twin.rebuild()
    assert rebuilt.shard.num_trainers == 1 and rebuilt.shard.applied_step == 2
    assert_same(rebuilt.shard, twin.oracle)


def test_a_shard_added_while_training_replays_from_fresh_tables(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    bucket_move.start_at(twin.oracle, 5)
    twin.logged.start_at(5)
    twin.step(5)
    rebuilt = twin.rebuild()
    assert rebuilt.recovery is not None and rebuilt.recovery["base"] == "fresh"
    assert_same(rebuilt.shard, twin.oracle)


def test_a_sync_step_half_pushed_when_the_shard_died_completes_after_the_rebuild(tmp_path: Path) -> None:
    twin = Twin(tmp_path, num_trainers=2)
    twin.checkpoint(0, "full")
    twin.step(0)
    ids_t, ids_u = np.array([1, 2, 3]), np.array([7, 8])
    twin.pull(ids_t, ids_u)
    twin.push(0, 1, ids_t, ids_u)  # trainer 1 has not pushed step 1 yet
    rebuilt = twin.rebuild()
    assert_same(rebuilt.shard, twin.oracle)
    # trainer 0 sends its push again (its reply was lost): dropped; trainer 1's completes the step
    assert not rebuilt.push(0, 1, 1, {"t": (ids_t, np.ones((3, DIM), np.float32))})
    twin.push(1, 1, ids_t, ids_u)
    assert twin.oracle.applied_step == rebuilt.shard.applied_step == 1
    assert_same(rebuilt.shard, twin.oracle)


def test_a_training_pull_sent_again_changes_nothing(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    ids = np.array([5, 6, 7])
    requests = {"t": ids, "u": ids}
    first = twin.logged.pull(requests, train=True, caller="c", request=1)
    twin.oracle.pull(requests)
    rebuilt = twin.rebuild()
    again = rebuilt.pull(requests, train=True, caller="c", request=1)  # the reply was lost
    for name in requests:
        np.testing.assert_array_equal(again[name], first[name])
    assert_same(rebuilt.shard, twin.oracle)  # the min_count sketch counted the ids once


def test_a_torn_last_record_is_dropped_and_the_log_goes_on(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    twin.step(0)
    _, segment = segment_paths(twin.log_dir)[-1]
    whole = segment.stat().st_size
    twin.logged.pull({"t": np.array([99]), "u": np.array([99])}, train=True, caller="c", request=2)
    with open(segment, "r+b") as file:  # the process died in the middle of writing this record
        file.truncate(whole + 10)
    rebuilt = twin.rebuild()
    assert rebuilt.recovery is not None and rebuilt.recovery["torn_record_dropped"]
    assert segment.stat().st_size == whole
    assert_same(rebuilt.shard, twin.oracle)  # the oracle never saw the torn pull
    twin.pulls = 1
    twin.step(1)
    assert_same(twin.rebuild().shard, twin.oracle)


def test_a_new_segment_replaces_the_old_only_once_its_base_is_written(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    twin.step(0)
    number, segment = segment_paths(twin.log_dir)[-1]
    # a new segment whose base record was cut short (killed while starting it): the old one is used
    (twin.log_dir / f"segment-{number + 1:06d}.log").write_bytes(b"PSRL\x00")
    rebuilt = twin.rebuild()
    assert rebuilt.recovery is not None and rebuilt.recovery["segment"] == segment.name
    assert_same(rebuilt.shard, twin.oracle)


def test_a_log_without_a_readable_segment_is_refused_by_name(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.logged.log.close()
    for _, path in segment_paths(twin.log_dir):
        path.write_bytes(b"garbage")
    with pytest.raises(PushLogError, match="no readable segment"):
        LoggedShard.open(new_shard(), twin.log_dir)


def test_a_push_that_raises_leaves_no_record(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.step(0)
    bad = {"t": (np.array([1, 2]), np.ones((3, DIM), np.float32))}
    with pytest.raises(ValueError, match="2 ids but 3 gradient rows"):
        twin.logged.push(0, 1, 1, bad)
    assert_same(twin.rebuild().shard, twin.oracle)


def test_a_process_that_cannot_see_the_log_refuses_fresh_tables(tmp_path: Path) -> None:
    """A restarted shard on a node without the log must not start over with fresh tables."""
    with pytest.raises(PushLogError, match="fault_tolerance.push_log"):
        LoggedShard.open(new_shard(), tmp_path / "elsewhere")


def test_a_record_of_more_buffers_than_one_write_takes_reads_back_whole(tmp_path: Path) -> None:
    """An import of many tables and snapshot fields is one record of over IOV_MAX arrays, 0-d
    string arrays among them: it is written whole and reads back with every shape and value."""
    log = PushLog(tmp_path)
    log.start_segment({"kind": "fresh"})
    arrays = {f"t{i}/rows": np.full((3, 2), i, np.float32) for i in range(1500)}
    arrays["t0/config"] = np.array('{"dim": 2}')
    log.append("import", {"move": "m"}, arrays)
    log.close()
    ((_, path),) = segment_paths(tmp_path)
    segment = read_segment(path)
    assert segment.torn is None and len(segment.records) == 1
    read = segment.records[0].arrays
    assert read.keys() == arrays.keys()
    for key, value in arrays.items():
        assert read[key].shape == value.shape and read[key].dtype == value.dtype
        np.testing.assert_array_equal(read[key], value)
