"""The disk tier's bad input and faults: a missing, non-writable or full directory is a clear error
naming it; a corrupted or torn record is never returned; a shard killed mid-demotion leaves no file
behind and comes back from its checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec, TableState, TieredTable
from psrec.embedding.disk_tier import DiskTierError, RecordLayout, check_disk_dir

OPTIMIZER = SparseOptimizerSpec("adagrad", lr=0.1)


def tiered(directory, memory_rows=4, **kwargs) -> TieredTable:
    return TieredTable(
        "items", 8, memory_rows=memory_rows, disk_dir=str(directory), optimizer=OPTIMIZER, **kwargs
    )


def fill(table: TieredTable, rows: int = 40) -> np.ndarray:
    ids = np.arange(rows, dtype=np.int64)
    table.pull(ids)
    table.push(ids, np.ones((rows, 8), dtype=np.float32), step=1)
    return ids


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DiskTierError, match=f"table 'items': storage.disk_dir '{missing}' does not exist"):
        tiered(missing)


def test_a_file_is_not_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(DiskTierError, match="is not a directory"):
        tiered(path)


def test_directory_not_writable(tmp_path):
    if os.geteuid() == 0:
        directory = Path("/proc")  # even root may not create files there
    else:
        directory = tmp_path / "readonly"
        directory.mkdir(mode=0o500)
    with pytest.raises(DiskTierError, match=f"'{directory}' is not writable"):
        tiered(directory)


def test_not_enough_free_space_before_training(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskTierError, match=f"'{tmp_path}' has .* GiB free, the disk tier needs"):
        check_disk_dir(tmp_path, table="items", needed_bytes=free * 2 + 2**30)
    assert check_disk_dir(tmp_path, table="items", needed_bytes=1) == tmp_path


def test_disk_full_while_demoting(tmp_path, monkeypatch):
    table = tiered(tmp_path)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(
        DiskTierError, match=f"disk tier in '{tmp_path}' cannot grow .*No space left on device"
    ):
        fill(table)


def _corrupt_first_record(table: TieredTable, *, offset: int, data: bytes) -> int:
    cold = table._cold
    ids, _, _ = cold.live()
    slot = int(cold.lookup(ids[:1])[0])
    os.pwrite(cold._file.fileno(), data, slot * cold.layout.record_bytes + offset)
    return int(ids[0])


@pytest.mark.parametrize("prefetched", [False, True])
@pytest.mark.parametrize("damage", ["bit_flip", "torn"])
def test_damaged_record_is_never_returned(tmp_path, damage, prefetched):
    table = tiered(tmp_path)
    fill(table)
    layout = table._cold.layout
    if damage == "bit_flip":
        victim = _corrupt_first_record(table, offset=5, data=b"\xff")
    else:  # the second half of a record from an older write: zeros where the new bytes never landed
        half = layout.record_bytes // 2
        victim = _corrupt_first_record(table, offset=half, data=bytes(layout.record_bytes - half))
    if prefetched:  # read ahead, the damaged record is read again on demand and fails there
        assert table.prefetch(np.array([victim], dtype=np.int64)) == 1
    with pytest.raises(RuntimeError, match=f"corrupt record.*first: id {victim}.*restore the shard"):
        table.pull(np.array([victim], dtype=np.int64))
    with pytest.raises(RuntimeError, match="corrupt record"):
        table.pull(np.array([victim], dtype=np.int64), train=False)


def test_record_layout_round_trip():
    layout = RecordLayout(5, precision="int8", optimizer="adam")
    assert layout.record_bytes % 8 == 0
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {
        "rows": rng.integers(0, 256, (3, 5)).astype(np.uint8),
        "row_scale": rng.random(3).astype(np.float32),
        "row_offset": rng.random(3).astype(np.float32),
        "optimizer_state/exp_avg": rng.random((3, 5)).astype(np.float32),
        "optimizer_state/exp_avg_sq": rng.random((3, 5)).astype(np.float32),
        "optimizer_state/step": np.array([1, 2, 3], dtype=np.int32),
        "counts": np.array([4, 5, 6], dtype=np.uint32),
        "last_step": np.array([7, 8, 9], dtype=np.uint32),
        "ids": np.array([-5, 0, 2**62], dtype=np.int64),
    }
    records = layout.pack(values)
    assert not layout.corrupt(records).any()
    unpacked = layout.unpack(records)
    for key, array in values.items():
        assert np.array_equal(unpacked[key], array) and unpacked[key].dtype == array.dtype, key


def test_file_is_released(tmp_path):
    table = tiered(tmp_path)
    fill(table)
    assert table.disk_tier_rows > 0
    assert os.listdir(tmp_path) == []  # unlinked at creation: nothing to clean up, nothing to reread
    table.close()


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from psrec.embedding import SparseOptimizerSpec, TieredTable

    directory, checkpoint = sys.argv[1], sys.argv[2]
    table = TieredTable("items", 8, memory_rows=50, disk_dir=directory,
                        optimizer=SparseOptimizerSpec("adagrad", lr=0.1))
    rng = np.random.default_rng(0)
    step = 0
    def train(steps):
        global step
        for _ in range(steps):
            step += 1
            ids = rng.integers(0, 5000, 400).astype(np.int64)
            table.pull(ids)
            table.push(ids, rng.standard_normal((400, 8)).astype(np.float32), step=step)
    train(20)
    np.savez(checkpoint, **table.export_state().to_arrays())
    print("checkpointed", flush=True)
    while True:
        train(1)  # every step promotes and demotes: the kill lands inside one of them
    """
)


def test_shard_killed_mid_demotion_recovers_from_checkpoint(tmp_path):
    directory = tmp_path / "disk"
    directory.mkdir()
    checkpoint = tmp_path / "checkpoint.npz"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), str(checkpoint)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "checkpointed"
        time.sleep(0.5)  # training on: demotions running
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert os.listdir(directory) == []  # the killed shard's slab went with it: no record to misread
    with np.load(checkpoint, allow_pickle=False) as saved:
        state = TableState.from_arrays(dict(saved))
    restored = tiered(directory, memory_rows=50)
    restored.import_state(state)
    oracle = EmbeddingTable("items", 8, optimizer=OPTIMIZER)
    oracle.import_state(state)
    assert restored.disk_tier_rows > 0
    ids = state.ids
    assert restored.pull(ids, train=False).tobytes() == oracle.pull(ids, train=False).tobytes()
    assert restored.export_state().rows.tobytes() == state.rows.tobytes()


def _file_backed_resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_disk_tier_adds_no_file_backed_resident_memory(tmp_path):
    """The slab is read and written with pread/pwrite, never mapped: moving 40 MiB of records through
    it leaves the process's file-backed resident memory where it was (a mapped slab grows it by the
    page-cache folios behind every record touched)."""
    table = TieredTable("items", 64, memory_rows=1000, disk_dir=str(tmp_path), optimizer=OPTIMIZER)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 150_000, 5000).astype(np.int64))
    table.pull(ids)  # compiles the kernels before the baseline
    before = peak = _file_backed_resident_bytes()
    for step in range(1, 31):
        ids = np.unique(rng.integers(0, 150_000, 5000).astype(np.int64))
        table.pull(ids)
        table.push(ids, np.ones((ids.shape[0], 64), np.float32), step=step)
        peak = max(peak, _file_backed_resident_bytes())
    assert table._cold.bytes_read + table._cold.bytes_written > 40 << 20
    assert peak - before < 1 << 20
