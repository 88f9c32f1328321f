"""TieredTable: an embedding table whose hot rows live in memory and cold rows on local disk.

The memory tier is the table itself (an ``EmbeddingTable``: hash index, rows at their precision,
optimizer state, ``[count, last step]``); the disk tier (``DiskTier``) holds every other row whole,
bytes as stored, so a row reads back bit for bit after any number of trips. A training pull first
looks its ids up in memory; the ids that miss are looked up on disk together and their rows
promoted (read in one batch, inserted into memory); only ids in neither tier go to admission and
get initial rows. Room is made first: when the rows that may arrive would take the memory tier past
``memory_rows``, the coldest rows not in the batch (``tier_policy``, LFU by default) are demoted in
one batch, down to ``memory_rows * (1 - DEMOTION_SLACK)`` less the arrivals. The victims are the
coldest of a uniform sample of about ``victim_sample`` memory rows per row demoted
(``tier_policy.sample_rows``; ``victim_sample=0`` ranks every row in memory), so choosing them costs
in proportion to the rows demoted, not to the memory tier. A batch with more distinct ids than
``memory_rows`` is held whole until its push: the memory tier holds at most ``max(memory_rows, one
batch's rows)``.

    table = TieredTable("items", 64, optimizer=SparseOptimizerSpec("adagrad", lr=0.05),
                        memory_rows=1_000_000, disk_dir="/mnt/ssd/psrec")
    rows = table.pull(ids)                      # same rows, same updates as an EmbeddingTable
    table.push(ids, grads, step=step)

Everything else is that of ``EmbeddingTable`` over both tiers: evaluation pulls read cold rows
without promoting them; pushes to cold rows promote them first; ``evict`` applies TTL and
``max_rows`` to all rows; ``export_state`` holds every row in both tiers (in id order, as the
in-memory table exports it); ``export_delta`` holds the rows changed since the marker in either
tier (moving between tiers is no change) and the ids removed from either; ``import_state`` and
``apply_delta`` place rows in memory by the same policy and the rest on disk. A state exported by
either kind of table imports into the other. Not thread-safe, like ``EmbeddingTable``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psrec.embedding.disk_tier import DiskTier, RecordLayout
from psrec.embedding.eviction import rows_to_evict
from psrec.embedding.hash_index import ids_digest
from psrec.embedding.slab_log import segment_rows_for
from psrec.embedding.specs import PREFETCH_MIN_ROWS, TableSpec
from psrec.embedding.state import TableDelta, TableState
from psrec.embedding.table import EmbeddingTable, spec_options
from psrec.embedding.tier_policy import AGING_HALF_LIFE_STEPS, POLICIES, VICTIM_SAMPLE, coldest, sample_rows

DEMOTION_SLACK = 0.05
OPTIMIZER_PREFIX = "optimizer_state/"


def build_table(spec: TableSpec) -> EmbeddingTable:
    """The table `spec` describes: a `TieredTable` when it has a storage tier, else in memory."""
    if spec.storage is None:
        return EmbeddingTable.from_spec(spec)
    return TieredTable(
        spec.name,
        spec.dim,
        **{**spec_options(spec), "initial_rows": min(spec.initial_rows, spec.storage.memory_rows)},
        memory_rows=spec.storage.memory_rows,
        disk_dir=spec.storage.disk_dir,
        prefetch_min_rows=spec.storage.prefetch_min_rows,
    )


def _flat(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """Exported rows (optimizer state nested) as the disk tier's flat field names."""
    flat = {key: value for key, value in record.items() if key != "optimizer_state" and value is not None}
    flat.update({OPTIMIZER_PREFIX + name: array for name, array in record["optimizer_state"].items()})
    return flat


def _nested(values: dict[str, np.ndarray]) -> dict[str, Any]:
    record: dict[str, Any] = {"optimizer_state": {}, "row_scale": None, "row_offset": None}
    for key, value in values.items():
        if key.startswith(OPTIMIZER_PREFIX):
            record["optimizer_state"][key[len(OPTIMIZER_PREFIX) :]] = value
        else:
            record[key] = value
    return record


def _subset(record: dict[str, Any], mask: np.ndarray) -> dict[str, Any]:
    subset: dict[str, Any] = {}
    for key, value in record.items():
        if key == "optimizer_state":
            subset[key] = {name: array[mask] for name, array in value.items()}
        else:
            subset[key] = None if value is None else value[mask]
    return subset


def _concat(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two exported row sets as one, in id order."""
    ids = np.concatenate([first["ids"], second["ids"]])
    order = np.argsort(ids, kind="stable")
    merged: dict[str, Any] = {"optimizer_state": {}}
    for key, value in first.items():
        if key == "optimizer_state":
            for name, array in value.items():
                merged["optimizer_state"][name] = np.concatenate([array, second[key][name]])[order]
        elif value is None:
            merged[key] = None
        else:
            merged[key] = np.concatenate([value, second[key]])[order]
    return merged


PER_STEP = ("promotions", "demotions", "disk_bytes_read", "disk_bytes_written")


def tier_rates(stats: dict[str, int]) -> dict[str, float]:
    """The rates of `tier_stats` counts (one table's, or summed over shards with ``steps`` the most
    any shard pushed): ``hit_rate`` (pulled ids found in memory) and each of ``PER_STEP`` per
    training step, as ``<name>_per_step``."""
    pulled = stats["pull_hits"] + stats["pull_misses"]
    rates = {"hit_rate": stats["pull_hits"] / pulled if pulled else 0.0}
    steps = max(stats["steps"], 1)
    rates.update({f"{name}_per_step": stats[name] / steps for name in PER_STEP})
    return rates


class TieredTable(EmbeddingTable):
    """An ``EmbeddingTable`` with at most ``memory_rows`` rows in memory, the rest under `disk_dir`."""

    def __init__(
        self,
        name: str,
        dim: int,
        *,
        memory_rows: int,
        disk_dir: str | os.PathLike[str],
        policy: str = "lfu",
        half_life_steps: float = AGING_HALF_LIFE_STEPS,
        victim_sample: int = VICTIM_SAMPLE,
        prefetch_min_rows: int = PREFETCH_MIN_ROWS,
        **table_arguments: Any,
    ) -> None:
        populate = table_arguments.pop("populate", True)
        super().__init__(name, dim, populate=False, **table_arguments)
        if isinstance(memory_rows, bool) or not isinstance(memory_rows, int | np.integer) or memory_rows < 1:
            raise ValueError(self._message(f"storage memory_rows must be an int >= 1, got {memory_rows!r}"))
        if policy not in POLICIES:
            raise ValueError(self._message(f"demotion policy must be one of {POLICIES}, got {policy!r}"))
        if not self.optimizer.lazy:
            raise ValueError(
                self._message(
                    "a table with a disk tier needs the lazy sparse optimizer (optimizer.lazy: true); the "
                    "non-lazy update steps every row at every push"
                )
            )
        self.memory_rows = int(memory_rows)
        self.policy = policy
        if not half_life_steps > 0:
            raise ValueError(self._message(f"half_life_steps must be > 0, got {half_life_steps!r}"))
        self.half_life_steps = float(half_life_steps)
        if (
            isinstance(victim_sample, bool)
            or not isinstance(victim_sample, int | np.integer)
            or victim_sample < 0
        ):
            raise ValueError(self._message(f"victim_sample must be an int >= 0, got {victim_sample!r}"))
        self.victim_sample = int(victim_sample)
        if (
            isinstance(prefetch_min_rows, bool)
            or not isinstance(prefetch_min_rows, int)
            or prefetch_min_rows < 0
        ):
            raise ValueError(
                self._message(f"prefetch_min_rows must be an int >= 0, got {prefetch_min_rows!r}")
            )
        # A shard reads a coming pull's cold rows ahead while the last training pull promoted at least
        # this many (`psrec.ps.shard.ParameterShard.prefetch`).
        self.prefetch_min_rows = prefetch_min_rows
        self._victim_rng = np.random.default_rng(self.seed)
        layout = RecordLayout(self.dim, precision=self.precision, optimizer=self.optimizer.name)
        self._cold = DiskTier(disk_dir, layout, table=name, segment_rows=segment_rows_for(self.memory_rows))
        if table_arguments.get("initial_rows") and populate:
            self._populate()
        self.hits = 0  # pulled ids found in memory
        self.misses = 0  # pulled ids not in memory (promoted, new, or not admitted)
        self.promotions = 0
        self.demotions = 0
        self.steps = 0  # training steps pushed (distinct step numbers in a row)
        self.last_promotions = 0  # rows the last training pull that missed promoted
        self._pushed_step: int | None = None

    # ---------------------------------------------------------------------------------- tiers
    @property
    def num_rows(self) -> int:
        return self._index.num_rows + self._cold.num_rows

    @property
    def memory_tier_rows(self) -> int:
        return self._index.num_rows

    @property
    def disk_tier_rows(self) -> int:
        return self._cold.num_rows

    def _promote(self, ids: np.ndarray) -> int:
        """Move the rows of `ids` (unique, not in memory) that are on disk into memory."""
        if self._cold.num_rows == 0 or ids.shape[0] == 0:
            return 0
        values = self._cold.take(ids)
        count = int(values["ids"].shape[0])
        if count:
            self._place(_nested(values))
            self.promotions += count
        return count

    def _place(self, record: dict[str, Any]) -> None:
        """Insert whole rows (absent from memory) into the memory tier, contents as given."""
        rows, _ = self._index.insert(record["ids"])
        self._sync_capacity()
        self._storage.assign(rows, record["rows"], record["row_scale"], record["row_offset"])
        for name, array in record["optimizer_state"].items():
            self._optimizer.state[name][rows] = array
        self._counts[rows] = record["counts"]
        self._last_step[rows] = record["last_step"]

    def _demote(self, rows: np.ndarray) -> None:
        record = self._export_rows(rows, by_id=False)  # the slot order of the records is free
        self._cold.write(_flat(record))
        self._last_pull = None
        self._index.remove(record["ids"])
        self.demotions += int(rows.shape[0])

    def _enforce_budget(self, protected: np.ndarray | None = None, incoming: int = 0) -> None:
        """Demote the coldest unprotected rows when memory would hold more than ``memory_rows`` once
        `incoming` more rows arrive."""
        if self._index.num_rows + incoming <= self.memory_rows:
            return
        target = max(int(self.memory_rows * (1 - DEMOTION_SLACK)) - incoming, 0)
        excluded = np.zeros(self._index.row_capacity, dtype=np.bool_)
        if protected is not None and protected.shape[0]:
            excluded[protected] = True
        excess = self._index.num_rows - target
        rows = None
        if self.victim_sample and excess * self.victim_sample * 2 < self._index.num_rows:
            index = self._index
            rows = sample_rows(
                index.tags, index.slots, excess * self.victim_sample, self._victim_rng, excluded=excluded
            )
            if rows.shape[0] < excess:  # most rows protected: rank them all
                rows = None
        if rows is None:
            rows = self._index.live_rows(sort=False)
            rows = rows[~excluded[rows]]
        victims = coldest(
            self.policy,
            min(rows.shape[0], excess),
            ids=self._index.keys[rows],
            counts=self._counts[rows],
            last_step=self._last_step[rows],
            clock=self._clock,
            half_life=self.half_life_steps,
        )
        if victims.shape[0]:
            self._demote(rows[victims])

    # ------------------------------------------------------------------------------ pull / push
    def pull(self, ids: np.ndarray, *, train: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        ids = self._check_ids(ids)
        self._check_out(ids, out)
        rows, missing = self._index.lookup(ids)
        if train:
            self.misses += missing
            self.hits += ids.shape[0] - missing
            self.last_promotions = 0
        if missing and not train:
            return self._evaluation_rows(ids, rows, out)
        if missing:  # room first, for every id that may arrive (promoted or new)
            arriving = np.unique(ids[rows < 0])
            self._enforce_budget(protected=rows[rows >= 0], incoming=arriving.shape[0])
            self.last_promotions = self._promote(arriving) if self._cold.num_rows else 0
            if self.last_promotions:  # a training pull: evaluation pulls returned above
                positions = np.flatnonzero(rows < 0)
                rows[positions], _ = self._index.lookup(ids[positions])
                missing = int(np.count_nonzero(rows < 0))
        if missing:
            missing_positions = np.flatnonzero(rows < 0)
            admitted = self._admission.admit(ids[missing_positions])
            if admitted.any():
                admitted_positions = missing_positions[admitted]
                rows[admitted_positions] = self._insert(ids[admitted_positions])
                missing = int(np.count_nonzero(rows < 0))
        if self._index.num_rows > self.memory_rows:  # after a batch larger than the budget
            self._enforce_budget(protected=rows[rows >= 0])
        if not missing:
            self._last_pull = (ids, rows, ids_digest(ids))
            return self._storage.gather(rows, out)
        present = rows >= 0
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        out[present] = self._storage.gather(rows[present])
        out[~present] = self._initial_rows(ids[~present])
        return out

    def prefetch(self, ids: np.ndarray) -> int:
        """Start reading the cold rows among `ids` (the next batch's) on a background thread while the
        caller computes; returns how many. The next training pull promotes them without waiting on
        the disk for the ones still current; any row changed since is read again, so the results are
        those without the prefetch."""
        ids = self._check_ids(ids)
        if self._cold.num_rows == 0 or ids.shape[0] == 0:
            return 0
        rows, missing = self._index.lookup(ids)
        if not missing:
            return 0
        return self._cold.prefetch(np.unique(ids[rows < 0]))

    def _evaluation_rows(self, ids: np.ndarray, rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """An evaluation pull's rows: memory rows, cold rows read without promotion, else initial."""
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        present = rows >= 0
        out[present] = self._storage.gather(rows[present])
        absent = np.flatnonzero(~present)
        unique, inverse = np.unique(ids[absent], return_inverse=True)
        slots = self._cold.lookup(unique)
        on_disk = slots >= 0
        values = np.empty((unique.shape[0], self.dim), dtype=np.float32)
        values[~on_disk] = self._initial_rows(unique[~on_disk])
        if on_disk.any():
            values[on_disk] = self._decode(self._cold.read(slots[on_disk], unique[on_disk]))
        out[absent] = values[inverse]
        return out

    def _decode(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """float32 rows of records read from disk, as `RowStorage.gather` decodes stored rows."""
        from psrec.embedding.precision import RowStorage

        count = values["ids"].shape[0]
        scratch = RowStorage(self.precision, self.dim, stochastic_rounding=False, seed=0)
        scratch.grow(count)
        positions = np.arange(count, dtype=np.int32)
        scratch.assign(positions, values["rows"], values.get("row_scale"), values.get("row_offset"))
        return scratch.gather(positions)

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int) -> None:
        ids = self._check_ids(ids)
        if self._cold.num_rows and not self._is_last_pull(ids):
            rows, missing = self._index.lookup(ids)
            if missing:
                arriving = np.unique(ids[rows < 0])
                self._enforce_budget(protected=rows[rows >= 0], incoming=arriving.shape[0])
                self._promote(arriving)
        super().push(ids, grads, step=step)
        if step != self._pushed_step:
            self.steps += 1
            self._pushed_step = step
        self._enforce_budget()

    def _is_last_pull(self, ids: np.ndarray) -> bool:
        last = self._last_pull
        if last is None or last[0].shape != ids.shape:
            return False
        return last[0] is ids or bool(np.array_equal(last[0], ids))

    # ----------------------------------------------------------------------------- remove / evict
    def _remove_present(self, ids: np.ndarray) -> int:
        removed = super()._remove_present(ids)
        cold_removed = self._cold.remove(ids)
        if cold_removed.shape[0]:
            self._removal_log.append((self._clock, cold_removed.copy()))
        return removed + int(cold_removed.shape[0])

    def evict(self, *, step: int) -> int:
        """TTL and ``max_rows`` over the rows of both tiers."""
        step = self._check_step(step)
        if self.eviction.ttl_steps is None and (
            self.eviction.max_rows is None or self.num_rows <= self.eviction.max_rows
        ):
            return 0
        rows = self._index.live_rows(sort=False)
        cold_ids, cold_counts, cold_steps = self._cold.live()
        ids = np.concatenate([self._index.keys[rows], cold_ids])
        victims = rows_to_evict(
            self.eviction,
            step=step,
            rows=np.arange(ids.shape[0]),
            ids=ids,
            counts=np.concatenate([self._counts[rows], cold_counts]),
            last_step=np.concatenate([self._last_step[rows], cold_steps]),
        )
        return self._remove_present(ids[victims])

    # ---------------------------------------------------------------------------- state export
    def _cold_rows(self, since_clock: int | None = None) -> dict[str, Any]:
        ids, _, last_step = self._cold.live()
        if since_clock is not None:
            ids = ids[last_step >= since_clock]
        slots = self._cold.lookup(ids)
        return _nested(self._cold.read(slots, ids))

    def export_state(self) -> TableState:
        state = super().export_state()
        if self._cold.num_rows == 0:
            return state
        merged = _concat(self._state_rows(state), self._cold_rows())
        return TableState(config=state.config, admission_sketch=state.admission_sketch, **merged)

    def export_delta(self, since: int) -> TableDelta:
        delta = super().export_delta(since)
        cold = self._cold_rows(self._marker_clock(since))
        if cold["ids"].shape[0] == 0:
            return delta
        merged = _concat(self._state_rows(delta), cold)
        return TableDelta(
            config=delta.config,
            removed_ids=delta.removed_ids,
            admission_sketch=delta.admission_sketch,
            **merged,
        )

    @staticmethod
    def _state_rows(record: TableState | TableDelta) -> dict[str, Any]:
        return {
            "ids": record.ids,
            "rows": record.rows,
            "row_scale": record.row_scale,
            "row_offset": record.row_offset,
            "counts": record.counts,
            "last_step": record.last_step,
            "optimizer_state": record.optimizer_state,
        }

    def import_state(self, state: TableState) -> None:
        """Replace the contents with `state`: its hottest rows (by the policy) in memory, the rest on
        disk."""
        self._check_compatible(state.config, "state")
        self._check_rows(state, "state")
        rows = self._state_rows(state)
        count = state.ids.shape[0]
        cold = np.zeros(count, dtype=np.bool_)
        if count > self.memory_rows:
            target = int(self.memory_rows * (1 - DEMOTION_SLACK))
            clock = int(state.config.get("clock", 0))
            cold[coldest(self.policy, count - target, ids=state.ids, counts=state.counts,
                         last_step=state.last_step, clock=clock, half_life=self.half_life_steps)] = True  # fmt: skip
        hot = _subset(rows, ~cold)
        self._cold.clear()
        super().import_state(TableState(config=state.config, admission_sketch=state.admission_sketch, **hot))
        self._cold.write(_flat(_subset(rows, cold)))

    def apply_delta(self, delta: TableDelta) -> None:
        self._check_compatible(delta.config, "delta")
        self._check_rows(delta, "delta")
        self._cold.remove(delta.ids)  # rewritten whole below, in memory
        super().apply_delta(delta)
        self._enforce_budget()

    # ------------------------------------------------------------------------------------ sizes
    def memory_bytes(self) -> dict[str, int]:
        sizes = super().memory_bytes()
        sizes["disk_index"] = self._cold.memory_bytes()
        sizes["total"] += sizes["disk_index"]
        return sizes

    def tier_stats(self) -> dict[str, int]:
        """Rows and bytes per tier and the traffic between them, since the table was built."""
        return {
            "memory_rows": self._index.num_rows,
            "memory_budget_rows": self.memory_rows,
            "disk_rows": self._cold.num_rows,
            "disk_bytes": self._cold.disk_bytes(),
            "pull_hits": self.hits,
            "pull_misses": self.misses,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "disk_bytes_read": self._cold.bytes_read,
            "disk_bytes_written": self._cold.bytes_written,
            "relocations": self._cold.relocations,
            "prefetch_hits": self._cold.prefetch_hits,
            "steps": self.steps,
        }

    def close(self) -> None:
        """Release the disk tier's file (also released when the process exits)."""
        self._cold.close()

    def __repr__(self) -> str:
        return (
            f"TieredTable({self.name!r}, dim={self.dim}, rows={self.num_rows}, memory_rows="
            f"{self._index.num_rows}/{self.memory_rows}, disk_rows={self._cold.num_rows}, "
            f"precision={self.precision!r}, optimizer={self.optimizer.name!r})"
        )
