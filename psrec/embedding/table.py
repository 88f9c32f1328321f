"""EmbeddingTable: a dynamic, collisionless embedding table with a fused sparse optimizer.

A table is a ``HashIndex`` (int64 id -> row) plus, per row: the payload (``RowStorage`` at fp32, fp16
or int8), the optimizer state (``SparseOptimizer``), an access count (uint32, gradient occurrences,
saturating) and the step of the last change (uint32). No vocabulary size is given: rows are created
on training pulls (subject to ``Admission``), removed by ``remove``/``evict``, and their slots reused.

    table = EmbeddingTable("user", 16, optimizer=SparseOptimizerSpec("rowwise_adagrad", lr=0.05))
    rows = table.pull(np.array([7, -3, 7], dtype=np.int64))           # (3, 16) float32
    table.push(np.array([7, -3, 7], dtype=np.int64), grads, step=1)   # the two 7s are summed

Initial rows are a function of (seed, id) only (``initializers``), so a sharded run equals a
single-process run. Delta markers: the table keeps a clock (the largest step pushed so far); each row
records the clock when it was last inserted or updated, each removal is logged with the clock, and a
marker is ``generation << 32 | clock`` where ``import_state`` starts a new generation. A delta since a
marker therefore holds every row changed after it (and possibly a few changed at the same clock just
before it, which is harmless: rows are written whole). Stale pushes (an async trainer's older step)
stamp rows with the clock, not their own step, so deltas and TTL never go backwards. Eviction runs
only when ``evict`` is called (the shard calls it every N steps). Capacity reserved with
``initial_rows`` is backed with memory when the table is built (``populate``, default on). Not
thread-safe: one caller at a time (the numba kernels release the GIL, so other threads run
meanwhile).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np

from psrec.allocator import populate
from psrec.embedding.admission import Admission
from psrec.embedding.arrays import grow_rows
from psrec.embedding.eviction import rows_to_evict
from psrec.embedding.hash_index import HashIndex, ids_digest
from psrec.embedding.initializers import initial_rows, write_initial_rows
from psrec.embedding.optimizers import SparseOptimizer, aggregate_gradients
from psrec.embedding.precision import RowStorage
from psrec.embedding.specs import (
    PRECISIONS,
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from psrec.embedding.state import TableDelta, TableState, layout_problem

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
MAX_STEP = 2**32 - 1


class EmbeddingTable:
    """One embedding table (or one shard's partition of it); see the module docstring."""

    @classmethod
    def from_spec(cls, spec: TableSpec) -> EmbeddingTable:
        """The in-memory table `spec` describes; a spec with a storage tier is built by
        `psrec.embedding.build_table` (a `TieredTable`, built on this module)."""
        if spec.storage is not None:
            raise ValueError(
                f"table {spec.name!r} has a storage tier: build it with psrec.embedding.build_table(spec)"
            )
        return cls(spec.name, spec.dim, **spec_options(spec))

    def __init__(
        self,
        name: str,
        dim: int,
        *,
        optimizer: SparseOptimizerSpec,
        initializer: InitializerSpec = InitializerSpec(),  # noqa: B008 - frozen dataclass
        precision: str = "fp32",
        stochastic_rounding: bool = False,
        admission: AdmissionSpec = AdmissionSpec(),  # noqa: B008
        eviction: EvictionSpec = EvictionSpec(),  # noqa: B008
        seed: int = 0,
        initial_rows: int = 0,
        populate: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"table name must be a non-empty string, got {name!r}")
        self.name = name
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(self._message(f"dim must be an int > 0, got {dim!r}"))
        for argument, value, kind in (
            ("optimizer", optimizer, SparseOptimizerSpec),
            ("initializer", initializer, InitializerSpec),
            ("admission", admission, AdmissionSpec),
            ("eviction", eviction, EvictionSpec),
        ):
            if not isinstance(value, kind):
                raise TypeError(
                    self._message(f"{argument} must be a {kind.__name__}, got {type(value).__name__}")
                )
        if precision not in PRECISIONS:
            raise ValueError(self._message(f"precision must be one of {PRECISIONS}, got {precision!r}"))
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise TypeError(self._message(f"seed must be an int, got {seed!r}"))
        self.dim = int(dim)
        self.precision = precision
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.initializer = initializer
        self.eviction = eviction
        if (
            isinstance(initial_rows, bool)
            or not isinstance(initial_rows, int | np.integer)
            or initial_rows < 0
        ):
            raise ValueError(self._message(f"initial_rows must be an int >= 0, got {initial_rows!r}"))
        self._index = HashIndex(initial_rows=int(initial_rows))  # capacity reserved up front
        self._storage = RowStorage(
            precision, self.dim, stochastic_rounding=self.stochastic_rounding, seed=self.seed
        )
        self._optimizer = SparseOptimizer(optimizer, self.dim)
        self._admission = Admission(admission, self.seed)
        self._metadata = np.zeros((0, 2), dtype=np.uint32)  # (rows, [count, last step]): one cache line
        self._clock = 0
        self._generation = 0
        self._removal_log: list[tuple[int, np.ndarray]] = []  # (clock at removal, removed ids)
        self._removals_kept_from = 0
        self._last_pull: tuple[np.ndarray, np.ndarray, int] | None = None  # (ids, rows, digest)
        self._sync_capacity()
        if initial_rows and populate:
            self._populate()

    # ----------------------------------------------------------------------------------- properties
    @property
    def num_rows(self) -> int:
        return self._index.num_rows

    @property
    def _counts(self) -> np.ndarray:
        return self._metadata[:, 0]

    @property
    def _last_step(self) -> np.ndarray:
        return self._metadata[:, 1]

    @property
    def optimizer(self) -> SparseOptimizerSpec:
        return self._optimizer.spec

    @property
    def admission(self) -> AdmissionSpec:
        return self._admission.spec

    def _message(self, problem: str) -> str:
        return f"table {self.name!r}: {problem}"

    # ----------------------------------------------------------------------------------- validation
    def _check_ids(self, ids: Any, argument: str = "ids") -> np.ndarray:
        if not isinstance(ids, np.ndarray):
            raise TypeError(
                self._message(f"{argument} must be a numpy int64 array, got {type(ids).__name__}")
            )
        if ids.dtype != np.int64:
            raise TypeError(self._message(f"{argument} must have dtype int64, got {ids.dtype}"))
        if ids.ndim != 1:
            raise ValueError(self._message(f"{argument} must be 1-D, got shape {ids.shape}"))
        return np.ascontiguousarray(ids)

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step <= MAX_STEP:
            raise ValueError(self._message(f"step must be an int in [0, {MAX_STEP}], got {step!r}"))
        return int(step)

    # ------------------------------------------------------------------------------------- storage
    def _sync_capacity(self) -> None:
        capacity = self._index.row_capacity
        if self._metadata.shape[0] >= capacity:
            return
        self._storage.grow(capacity)
        self._optimizer.grow(capacity)
        self._metadata = grow_rows(self._metadata, capacity)

    def _populate(self) -> None:
        """Back the reserved capacity with memory now, not at the steps that first write it."""
        started = time.perf_counter()
        index, storage = self._index, self._storage
        arrays = (index.tags, index.slots, index.keys, storage.values, storage.scales, storage.offsets)
        for array in (*arrays, self._metadata, *self._optimizer.state.values()):
            if array is not None:
                populate(array)
        logger.debug(
            "table %r: populated %.1f MiB of reserved rows in %.2f s",
            self.name,
            self.memory_bytes()["total"] / 2**20,
            time.perf_counter() - started,
        )

    def _initial_rows(self, ids: np.ndarray) -> np.ndarray:
        """Initial rows as a stored row would read back (rounded to the storage precision)."""
        return self._storage.round_trip(initial_rows(ids, self.dim, self.initializer, self.seed), ids)

    def _insert(self, ids: np.ndarray, *, initialise: bool = True) -> np.ndarray:
        """Rows of ``ids``, inserting and (unless the caller writes every field of them) initialising
        the new ones."""
        rows, inserted = self._index.insert(ids)
        self._sync_capacity()
        if initialise and inserted.any():
            new_rows = rows[inserted]
            new_ids = ids[inserted]
            if self.precision == "fp32":  # straight into storage (an fp32 row stores as it is)
                write_initial_rows(self._storage.values, new_rows, new_ids, self.initializer, self.seed)
            else:
                values = initial_rows(new_ids, self.dim, self.initializer, self.seed)
                self._storage.write(new_rows, values, new_ids, 0, stochastic=False)
            self._optimizer.reset_rows(new_rows)
            self._counts[new_rows] = 0
            self._last_step[new_rows] = self._clock
        return rows

    # ---------------------------------------------------------------------------------- pull / push
    def _check_out(self, ids: np.ndarray, out: np.ndarray | None) -> None:
        """A pull's `out=` must be a C-contiguous float32 (len(ids), dim) array."""
        if out is not None and (
            out.dtype != np.float32 or out.shape != (ids.shape[0], self.dim) or not out.flags.c_contiguous
        ):
            raise ValueError(
                self._message(
                    f"pull out= must be a C-contiguous float32 array of shape {(ids.shape[0], self.dim)}, "
                    f"got {out.dtype} {out.shape}"
                )
            )

    def pull(self, ids: np.ndarray, *, train: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """(len(ids), dim) float32 rows in the order of ``ids``; see the module docstring. With `out`
        (a C-contiguous float32 array of that shape) the rows are written there, and `out` returned."""
        ids = self._check_ids(ids)
        self._check_out(ids, out)
        rows, missing = self._index.lookup(ids)
        if missing and train:
            missing_positions = np.flatnonzero(rows < 0)
            admitted = self._admission.admit(ids[missing_positions])
            if admitted.any():
                admitted_positions = missing_positions[admitted]
                rows[admitted_positions] = self._insert(ids[admitted_positions])
                missing = int(np.count_nonzero(rows < 0))
        if not missing:
            if train:
                self._last_pull = (ids, rows, ids_digest(ids))
            return self._storage.gather(rows, out)
        present = rows >= 0
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        out[present] = self._storage.gather(rows[present])
        out[~present] = self._initial_rows(ids[~present])
        return out

    def push(self, ids: np.ndarray, grads: np.ndarray, *, step: int) -> None:
        """Sum duplicate ids' gradients and apply one optimizer step to each present row."""
        ids = self._check_ids(ids)
        if not isinstance(grads, np.ndarray):
            raise TypeError(self._message(f"grads must be a numpy float32 array, got {type(grads).__name__}"))
        if grads.dtype != np.float32:
            raise TypeError(self._message(f"grads must have dtype float32, got {grads.dtype}"))
        if grads.shape != (ids.shape[0], self.dim):
            raise ValueError(
                self._message(f"grads must have shape {(ids.shape[0], self.dim)}, got {grads.shape}")
            )
        step = self._check_step(step)
        grads = np.ascontiguousarray(grads)
        rows = self._pulled_rows(ids)
        if rows is None:
            rows, _ = self._index.lookup(ids)
        unique_rows, gradients, gradient_rows, occurrences, finite = aggregate_gradients(rows, grads)
        if not finite:
            raise ValueError(self._message("grads contain NaN or Inf"))
        self._clock = max(self._clock, step)
        if not self._optimizer.spec.lazy:
            unique_rows, gradients, gradient_rows, occurrences = self._with_untouched_rows(
                unique_rows, gradients, gradient_rows, occurrences
            )
        if unique_rows.shape[0] == 0:
            return
        record = (self._metadata, occurrences, self._clock)
        if self.precision == "fp32":
            self._optimizer.update(
                self._storage.values, unique_rows, unique_rows, gradients, gradient_rows, *record
            )
        else:
            scratch = self._storage.gather(unique_rows)
            positions = np.arange(unique_rows.shape[0], dtype=np.int32)
            self._optimizer.update(scratch, positions, unique_rows, gradients, gradient_rows, *record)
            self._storage.write(unique_rows, scratch, self._index.keys[unique_rows], step, stochastic=True)

    def _pulled_rows(self, ids: np.ndarray) -> np.ndarray | None:
        """The rows of the last training pull (one whose ids were all present) when `ids` holds the
        same ids in the same order. Rows keep their numbers until a removal (which forgets the pull),
        so the push that follows its pull (the trainer's step) skips the hash lookup: cache misses,
        after forward and backward, against two sequential passes here. The decision is by value, so a
        push may pass any array (a copy, or one that crossed a process): `ids` must equal the pulled
        array now, and its digest must equal the pulled ids' digest at the pull, so an array changed
        in place since the pull is looked up."""
        last, self._last_pull = self._last_pull, None
        if last is None:
            return None
        pulled_ids, rows, digest = last
        if pulled_ids.shape != ids.shape or ids_digest(ids) != digest:
            return None
        if pulled_ids is not ids and not np.array_equal(pulled_ids, ids):
            return None
        return rows

    def _with_untouched_rows(
        self, rows: np.ndarray, gradients: np.ndarray, gradient_rows: np.ndarray, occurrences: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The non-lazy update's operands: every live row, untouched ones with a zero gradient."""
        untouched = np.setdiff1d(self._index.live_rows(sort=False), rows, assume_unique=True)
        if untouched.shape[0] == 0:
            return rows, gradients, gradient_rows, occurrences
        zero_row = gradients.shape[0]
        gradients = np.concatenate([gradients, np.zeros((1, self.dim), dtype=np.float32)])
        return (
            np.concatenate([rows, untouched.astype(np.int32)]),
            gradients,
            np.concatenate([gradient_rows, np.full(untouched.shape[0], zero_row, dtype=np.int32)]),
            np.concatenate([occurrences, np.zeros(untouched.shape[0], dtype=np.int32)]),
        )

    def set_learning_rate(self, lr: float) -> None:
        """Change the learning rate (e.g. decay on plateau); FTRL's ``alpha`` is the learning rate."""
        try:
            self._optimizer.spec = replace(self._optimizer.spec, lr=lr)
        except ValueError as error:
            raise ValueError(self._message(str(error))) from None

    # ------------------------------------------------------------------------------ remove / evict
    def _remove_present(self, ids: np.ndarray) -> int:
        self._last_pull = None  # freed rows may be reused
        freed = self._index.remove(ids)
        removed_ids = ids[freed >= 0]
        if removed_ids.shape[0]:
            self._removal_log.append((self._clock, removed_ids.copy()))
        return int(removed_ids.shape[0])

    def remove(self, ids: np.ndarray) -> int:
        """Remove the given ids (absent ones are ignored); returns the number of rows removed."""
        return self._remove_present(self._check_ids(ids))

    def evict(self, *, step: int) -> int:
        """Apply the TTL and ``max_rows`` policies now; returns the number of rows removed."""
        step = self._check_step(step)
        if self.eviction.ttl_steps is None and (
            self.eviction.max_rows is None or self.num_rows <= self.eviction.max_rows
        ):
            return 0
        rows = self._index.live_rows(sort=False)
        victims = rows_to_evict(
            self.eviction,
            step=step,
            rows=rows,
            ids=self._index.keys[rows],
            counts=self._counts[rows],
            last_step=self._last_step[rows],
        )
        removed = self._remove_present(self._index.keys[victims])
        if removed:
            logger.debug("table %r: evicted %d rows at step %d", self.name, removed, step)
        return removed

    # ------------------------------------------------------------------------------- state export
    def config(self) -> dict[str, Any]:
        """JSON-able description of the table (what an exported state must be compatible with)."""
        return {
            "format": STATE_FORMAT,
            "name": self.name,
            "dim": self.dim,
            "precision": self.precision,
            "stochastic_rounding": self.stochastic_rounding,
            "seed": self.seed,
            "optimizer": self.optimizer.as_dict(),
            "initializer": self.initializer.as_dict(),
            "admission": self.admission.as_dict(),
            "eviction": self.eviction.as_dict(),
            "clock": self._clock,
            "admission_pull_counter": self._admission.pull_counter,
        }

    def _export_rows(self, rows: np.ndarray, *, by_id: bool = True) -> dict[str, Any]:
        if by_id:  # canonical order (states, deltas); else in the order of `rows`
            rows = rows[np.argsort(self._index.keys[rows], kind="stable")]
        payload = self._storage.export(rows)
        return {
            "ids": self._index.keys[rows],
            "rows": payload["rows"],
            "row_scale": payload["row_scale"],
            "row_offset": payload["row_offset"],
            "counts": self._counts[rows],
            "last_step": self._last_step[rows],
            "optimizer_state": {name: array[rows] for name, array in self._optimizer.state.items()},
        }

    def export_state(self) -> TableState:
        rows = self._index.live_rows(sort=False)
        sketch = None if self._admission.sketch is None else self._admission.sketch.copy()
        return TableState(config=self.config(), admission_sketch=sketch, **self._export_rows(rows))

    def _check_compatible(self, config: dict[str, Any], what: str) -> None:
        mine = self.config()
        if config.get("format") != STATE_FORMAT:
            raise ValueError(
                self._message(f"{what} has format {config.get('format')!r}, expected {STATE_FORMAT}")
            )
        for key in ("dim", "precision", "seed", "initializer"):
            if config.get(key) != mine[key]:
                raise ValueError(
                    self._message(f"{what} has {key}={config.get(key)!r}, this table has {mine[key]!r}")
                )
        other_optimizer = (config.get("optimizer") or {}).get("name")
        if other_optimizer != self.optimizer.name:
            raise ValueError(
                self._message(
                    f"{what} has optimizer {other_optimizer!r}, this table has {self.optimizer.name!r}"
                )
            )

    def _checked_sketch(self, record: TableState | TableDelta, what: str) -> np.ndarray | None:
        """This table's admission sketch, after checking `record`'s has its shape."""
        sketch = self._admission.sketch
        theirs = record.admission_sketch
        if sketch is not None and theirs is not None and theirs.shape != sketch.shape:
            raise ValueError(
                self._message(f"{what} admission sketch has shape {theirs.shape}, expected {sketch.shape}")
            )
        return sketch

    def _check_rows(self, record: TableState | TableDelta, what: str, *, unique: bool = True) -> None:
        """Every array of `record` in its shape and dtype, and (with `unique`) no id twice."""
        count = record.ids.shape[0]
        self._check_ids(record.ids, f"{what} ids")
        problem = layout_problem(
            record, dim=self.dim, precision=self.precision, optimizer=self.optimizer.name
        )
        if problem is not None:
            raise ValueError(self._message(f"{what} {problem}"))
        if unique and np.unique(record.ids).shape[0] != count:
            raise ValueError(self._message(f"{what} ids contain duplicates"))

    def _write_rows(self, record: TableState | TableDelta) -> None:
        # every field of the rows is written below: new rows need no initial values first
        rows = self._insert(record.ids, initialise=False) if record.ids.shape[0] else np.zeros(0, np.int32)
        self._assign_rows(rows, record)

    def _assign_rows(self, rows: np.ndarray | slice, record: TableState | TableDelta) -> None:
        self._storage.assign(rows, record.rows, record.row_scale, record.row_offset)
        for name, array in record.optimizer_state.items():
            self._optimizer.state[name][rows] = array
        self._counts[rows] = record.counts
        self._last_step[rows] = record.last_step

    def import_state(self, state: TableState) -> None:
        """Replace the contents with ``state``; the table's own hyperparameters are kept except the
        learning rate, which is taken from the state (it may have been decayed)."""
        self._check_compatible(state.config, "state")
        self._check_rows(state, "state", unique=False)
        sketch = self._checked_sketch(state, "state")
        # The new index, built before anything changes, finds a repeated id (no first occurrence)
        # in one hashing pass (a sort of millions of ids costs seconds of a recovery).
        index = HashIndex(initial_rows=state.ids.shape[0])
        rows, inserted = index.insert(self._check_ids(state.ids, "state ids"))
        if not inserted.all():
            raise ValueError(self._message("state ids contain duplicates"))
        lr = float(state.config.get("optimizer", {}).get("lr", self.optimizer.lr))
        self.set_learning_rate(lr)
        self._index = index
        self._last_pull = None
        self._metadata = np.zeros((0, 2), dtype=np.uint32)
        self._storage = RowStorage(
            self.precision, self.dim, stochastic_rounding=self.stochastic_rounding, seed=self.seed
        )
        self._optimizer = SparseOptimizer(self._optimizer.spec, self.dim)
        self._sync_capacity()
        self._clock = int(state.config.get("clock", 0))
        # a new index numbers new ids in order: rows 0..n-1 are written as blocks, not row by row
        count = state.ids.shape[0]
        self._assign_rows(slice(0, count) if np.array_equal(rows, np.arange(count)) else rows, state)
        if sketch is not None:
            sketch[:] = 0 if state.admission_sketch is None else state.admission_sketch
        self._admission.pull_counter = int(state.config.get("admission_pull_counter", 0))
        self._generation += 1
        self._removal_log = []
        self._removals_kept_from = 0

    # ---------------------------------------------------------------------------------------- deltas
    def delta_marker(self) -> int:
        """Opaque, monotone marker of "now" for ``export_delta``."""
        return (self._generation << 32) | self._clock

    def _marker_clock(self, marker: Any) -> int:
        """The clock part of a marker of this generation whose removal records are still kept."""
        if not isinstance(marker, int | np.integer) or marker < 0 or (int(marker) >> 32) != self._generation:
            raise ValueError(
                self._message(
                    f"marker {marker!r} is not from the current generation (import_state resets deltas)"
                )
            )
        clock = int(marker) & MAX_STEP
        if clock < self._removals_kept_from:
            raise ValueError(
                self._message(
                    f"marker {marker!r} is older than the removal records kept (forget_deltas_before was "
                    f"called with clock {self._removals_kept_from}); take a full export_state instead"
                )
            )
        return clock

    def export_delta(self, since: int) -> TableDelta:
        """Rows inserted/updated and ids removed since ``since`` (a ``delta_marker`` of this table)."""
        since_clock = self._marker_clock(since)
        rows = self._index.live_rows(sort=False)
        rows = rows[self._last_step[rows] >= since_clock]
        removed = [ids for clock, ids in self._removal_log if clock >= since_clock]
        config = self.config() | {"since": int(since), "until": self.delta_marker()}
        removed_ids = np.concatenate(removed) if removed else np.zeros(0, dtype=np.int64)
        sketch = None if self._admission.sketch is None else self._admission.sketch.copy()
        return TableDelta(
            config=config, removed_ids=removed_ids, admission_sketch=sketch, **self._export_rows(rows)
        )

    def forget_deltas_before(self, marker: int) -> None:
        """Drop the removal records older than ``marker`` to bound their memory (8 bytes per removed
        id); call it once no consumer will ask for a delta since an older marker (e.g. after a
        checkpoint is committed). Older markers are refused from then on."""
        clock = self._marker_clock(marker)
        self._removal_log = [(when, ids) for when, ids in self._removal_log if when >= clock]
        self._removals_kept_from = clock

    def apply_delta(self, delta: TableDelta) -> None:
        """Apply a delta exported by a compatible table: remove, then write rows whole; take its clock
        and admission state."""
        self._check_compatible(delta.config, "delta")
        self._check_rows(delta, "delta")
        removed_ids = self._check_ids(delta.removed_ids, "delta removed_ids")
        sketch = self._checked_sketch(delta, "delta")
        self._remove_present(removed_ids)
        if delta.last_step.shape[0]:
            self._clock = max(self._clock, int(delta.last_step.max()))
        self._clock = max(self._clock, int(delta.config.get("clock", 0)))
        self._write_rows(delta)
        if sketch is not None and delta.admission_sketch is not None:
            sketch[:] = delta.admission_sketch
        if "admission_pull_counter" in delta.config:
            self._admission.pull_counter = int(delta.config["admission_pull_counter"])

    # ---------------------------------------------------------------------------------------- memory
    def row_bytes(self) -> int:
        """Bytes the rows held in memory take (payload, optimizer state, index entry and metadata
        per row), without the capacity reserved for rows to come or left by rows removed."""
        sizes = self.memory_bytes()
        per_row = (sizes["total"] - sizes["admission"]) / max(self._index.row_capacity, 1)
        return int(round(per_row * self._index.num_rows))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held, including reserved-but-unused capacity."""
        sizes = {
            "payload": self._storage.nbytes(),
            "optimizer": self._optimizer.nbytes(),
            "index": self._index.nbytes(),
            "metadata": int(self._metadata.nbytes),
            "admission": self._admission.nbytes(),
        }
        sizes["total"] = sum(sizes.values())
        return sizes

    def __repr__(self) -> str:
        return (
            f"EmbeddingTable({self.name!r}, dim={self.dim}, rows={self.num_rows}, precision={self.precision!r}, "
            f"optimizer={self.optimizer.name!r})"
        )


def spec_options(spec: TableSpec) -> dict[str, Any]:
    """The keyword arguments of a table's constructor that `spec` holds (besides name and dim)."""
    return {
        "optimizer": spec.optimizer,
        "initializer": spec.initializer,
        "precision": spec.precision,
        "stochastic_rounding": spec.stochastic_rounding,
        "admission": spec.admission,
        "eviction": spec.eviction,
        "seed": spec.seed,
        "initial_rows": spec.initial_rows,
        "populate": spec.populate,
    }
