"""The log-structured slab: ``SegmentLog``'s accounting against a per-slot reference, and the disk
tier's prefetch never serving a record that changed after it was read ahead."""

from __future__ import annotations

import numpy as np
import pytest

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec, TieredTable
from psrec.embedding.disk_tier import DiskTier, RecordLayout
from psrec.embedding.slab_log import CLEAN_MAX_LIVE, SegmentLog

OPTIMIZER = SparseOptimizerSpec("adagrad", lr=0.1)
DIM = 4


def test_segment_log_matches_a_per_slot_reference():
    """Random appends and releases: live counts per segment are those of a per-slot liveness array,
    a run never hands out a live slot, runs stay inside one segment, an empty sealed segment is
    reused, and the cleaning candidate is the emptiest sealed segment within CLEAN_MAX_LIVE."""
    rng = np.random.default_rng(0)
    log = SegmentLog(8)
    live = np.zeros(0, dtype=np.bool_)  # the reference: per slot
    for _ in range(400):
        if rng.random() < 0.6:
            run = log.next_run(int(rng.integers(1, 12)))
            if run is None:
                candidate = log.cleaning_candidate()
                if candidate is None or rng.random() < 0.3:
                    log.add_segments(2)
                    live = np.concatenate([live, np.zeros(16, dtype=np.bool_)])
                else:
                    slots = log.slots_of(candidate)
                    log.release(slots[live[slots]])
                    live[slots] = False
                    assert log.live[candidate] == 0
                continue
            first, count = run
            assert count >= 1 and first // 8 == (first + count - 1) // 8
            assert not live[first : first + count].any()
            live[first : first + count] = True
        elif live.any():
            slots = rng.choice(np.flatnonzero(live), size=int(rng.integers(1, 6)), replace=True)
            slots = np.unique(slots)
            log.release(slots)
            live[slots] = False
        assert np.array_equal(log.live, live.reshape(-1, 8).sum(axis=1))
        candidate = log.cleaning_candidate()
        if candidate is not None:
            assert candidate != log.open_head and log.live[candidate] <= CLEAN_MAX_LIVE * 8
    small = SegmentLog(2)
    small.add_segments(1)
    assert small.next_run(5) == (0, 2)
    small.release(np.array([0, 1]))
    with pytest.raises(RuntimeError, match="released twice"):
        small.release(np.array([0]))


def _values(layout: RecordLayout, ids: np.ndarray, fill: float) -> dict[str, np.ndarray]:
    count = ids.shape[0]
    values: dict[str, np.ndarray] = {"ids": ids}
    for field in layout.fields:
        if field.name != "ids":
            shape = (count,) if field.width == 1 else (count, field.width)
            values[field.name] = np.full(shape, fill).astype(field.dtype)
    return values


def test_prefetch_never_serves_a_record_rewritten_in_the_same_slot(tmp_path):
    """Rows 1 and 2 are read ahead from slots 0 and 1 (one segment of two slots); row 1 is then
    removed and written again with new contents: the log cleans the segment (row 2 moves) and
    reuses it, so row 1's new record lands in slot 0 again. The read returns the new record, not
    the prefetched one; records still current are taken from a prefetch."""
    layout = RecordLayout(DIM, precision="fp32", optimizer="adagrad")
    tier = DiskTier(tmp_path, layout, table="t", segment_rows=2)
    both = np.array([1, 2], dtype=np.int64)
    tier.write(_values(layout, both, 1.0))
    assert tier.prefetch(both) == 2
    tier.remove(both[:1])
    tier.write(_values(layout, both[:1], 7.0))
    slots = tier.lookup(both)
    assert slots.tolist() == [0, 1] and tier.relocations == 1  # same slots, rewritten
    values = tier.read(slots, both)
    assert np.all(values["rows"][0] == 7.0) and np.all(values["rows"][1] == 1.0)
    assert tier.prefetch_hits == 0
    tier.prefetch(both)
    values = tier.take(both)
    assert tier.prefetch_hits == 2
    assert np.all(values["rows"][0] == 7.0) and np.all(values["rows"][1] == 1.0)
    assert tier.num_rows == 0
    tier.close()


def test_prefetched_rows_changed_by_a_delta_are_read_fresh(tmp_path):
    """A follower reads the next batch's rows ahead, then a delta rewrites half of them (they land
    on disk again, in reused segments): the pull gives the rows the in-memory table gives, the
    unchanged half taken from the prefetch."""
    rng = np.random.default_rng(1)
    source = EmbeddingTable("t", DIM, optimizer=OPTIMIZER)
    oracle = EmbeddingTable("t", DIM, optimizer=OPTIMIZER)
    tiered = TieredTable("t", DIM, memory_rows=40, disk_dir=str(tmp_path), optimizer=OPTIMIZER)
    ids = np.arange(400, dtype=np.int64)
    for table in (source, oracle, tiered):
        table.pull(ids)
        table.push(ids, np.ones((400, DIM), np.float32), step=1)
    marker = source.delta_marker()
    for step in range(2, 12):
        batch = np.unique(rng.integers(0, 400, 120)).astype(np.int64)
        assert tiered.prefetch(batch) > 0
        changed = batch[::2]  # half the prefetched rows change before the pull
        source.pull(changed)
        source.push(changed, rng.standard_normal((changed.shape[0], DIM)).astype(np.float32), step=step)
        delta = source.export_delta(marker)
        marker = source.delta_marker()
        oracle.apply_delta(delta)
        tiered.apply_delta(delta)
        assert tiered.pull(batch).tobytes() == oracle.pull(batch).tobytes()
        tiered.push(batch, np.ones((batch.shape[0], DIM), np.float32), step=step)
        oracle.push(batch, np.ones((batch.shape[0], DIM), np.float32), step=step)
    assert tiered.tier_stats()["prefetch_hits"] > 0 and tiered.tier_stats()["relocations"] > 0
    assert tiered.export_state().rows.tobytes() == oracle.export_state().rows.tobytes()
    tiered.close()


def test_prefetch_leaves_training_unchanged(tmp_path):
    """Training with the next batch read ahead gives the rows of the run without it, to the bit."""
    rng = np.random.default_rng(2)
    batches = [np.unique(rng.zipf(1.3, 300) % 2000).astype(np.int64) for _ in range(30)]
    plain = TieredTable("t", DIM, memory_rows=60, disk_dir=str(tmp_path), optimizer=OPTIMIZER)
    ahead = TieredTable("t", DIM, memory_rows=60, disk_dir=str(tmp_path), optimizer=OPTIMIZER)
    for step, batch in enumerate(batches, start=1):
        grads = rng.standard_normal((batch.shape[0], DIM)).astype(np.float32)
        assert plain.pull(batch).tobytes() == ahead.pull(batch).tobytes()
        if step < len(batches):
            ahead.prefetch(batches[step])
        plain.push(batch, grads, step=step)
        ahead.push(batch, grads, step=step)
    assert ahead.tier_stats()["prefetch_hits"] > 0
    assert plain.export_state().rows.tobytes() == ahead.export_state().rows.tobytes()
