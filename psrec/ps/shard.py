"""A parameter-server shard: its partition of every embedding table, and the push protocol.

`ParameterShard` is a plain object (no Ray): the Ray actor in `psrec.ps.actors` wraps it, and the
in-process runtime and the unit tests use it directly. It adds to the embedding engine's tables:

- **sync mode**: gradients pushed for step s by each of the `num_trainers` trainers are buffered
  and applied together, once, when the last trainer's push for s arrives — so N trainers with batch
  b update the tables exactly like one trainer with batch N*b;
- **async mode**: each push is applied on arrival;
- **idempotence**: every push carries a request id that grows per trainer; a push whose id is not
  newer than the last one applied (or buffered) for that trainer is a retry and is dropped, so a
  push retried after a crash is applied at most once;
- **row versions** (opt-in, for tests of bounded staleness): after `record_versions()`, the shard
  counts the updates applied to every row (its version) and logs, for every training pull, the
  version of each row it returned (`version_log()`). A sync step of N trainers is one update of a
  row, an async push one update per push. Off, it costs one attribute test per pull and push.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from psrec.embedding import EmbeddingTable, TableDelta, TableState, TieredTable

logger = logging.getLogger(__name__)

# table name -> (unique ids, gradient rows)
TableGradients = dict[str, tuple[np.ndarray, np.ndarray]]


# One training pull's row versions: table -> (ids, updates applied to each id's row when it was read)
VersionRead = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class _VersionLog:
    versions: dict[str, dict[int, int]] = field(default_factory=dict)  # table -> id -> version
    reads: list[VersionRead] = field(default_factory=list)

    def updated(self, table: str, ids: np.ndarray) -> None:
        versions = self.versions.setdefault(table, {})
        for key in np.unique(ids).tolist():  # one update per row, however many trainers sent it
            versions[key] = versions.get(key, 0) + 1

    def read(self, requests: dict[str, np.ndarray]) -> None:
        read: VersionRead = {}
        for table, ids in requests.items():
            versions = self.versions.get(table, {})
            read[table] = (ids.copy(), np.array([versions.get(key, 0) for key in ids.tolist()], np.int64))
        self.reads.append(read)


@dataclass
class _PendingStep:
    step: int
    trainers: set[int] = field(default_factory=set)
    gradients: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)


class ParameterShard:
    """One shard's tables plus the sync/async push protocol (see the module docstring)."""

    def __init__(
        self,
        shard_index: int,
        tables: dict[str, EmbeddingTable],
        *,
        num_trainers: int = 1,
        mode: str = "sync",
    ) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"shard mode must be 'sync' or 'async', got {mode!r}")
        self.shard_index = shard_index
        self.tables = tables
        self.num_trainers = num_trainers
        self.mode = mode
        self.applied_step = -1  # last step whose updates are fully applied
        self.last_request: dict[int, int] = {}  # trainer -> last request id applied or buffered
        self.pushes_applied = 0
        self.pushes_dropped = 0
        self._pending: _PendingStep | None = None
        self._snapshots: dict[str, dict[str, TableState]] = {}
        self._markers = {name: table.delta_marker() for name, table in tables.items()}
        self._staged_markers: dict[str, int] = {}
        self.needs_full_checkpoint = False
        self._version_log: _VersionLog | None = None

    @property
    def pending_step(self) -> int | None:
        """The sync step still waiting for some trainers' pushes, or None between steps."""
        return None if self._pending is None else self._pending.step

    def record_versions(self) -> None:
        """Count every row's updates from now on and log each training pull's versions (see the
        module docstring); a new call starts from zero. Restores and snapshots are not tracked."""
        self._version_log = _VersionLog()

    def version_log(self) -> list[VersionRead]:
        """Every training pull since `record_versions`, in arrival order: table -> (ids, versions)."""
        if self._version_log is None:
            raise RuntimeError(f"shard {self.shard_index}: record_versions() was not called")
        return self._version_log.reads

    def pull(
        self,
        requests: dict[str, np.ndarray],
        *,
        train: bool = True,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows (n, dim) float32 for each table's ids; in training, new admitted ids are inserted.
        A table named in `out` gets its rows written into that array (see `EmbeddingTable.pull`)."""
        out = out or {}
        rows = {
            name: self._table(name).pull(ids, train=train, out=out.get(name))
            for name, ids in requests.items()
        }
        if train and self._version_log is not None:
            self._version_log.read(requests)
        return rows

    def prefetch(self, requests: dict[str, np.ndarray]) -> int:
        """Start reading the cold rows of a coming training pull's ids while the caller computes
        (`TieredTable.prefetch`), in the tables with a disk tier whose last such pull promoted at
        least their ``prefetch_min_rows`` rows (for fewer, issuing it costs more than the read it
        moves); returns the rows being read. Changes no result: the pull that follows returns what it would
        without it."""
        return sum(
            table.prefetch(ids)
            for name, ids in requests.items()
            if isinstance(table := self._table(name), TieredTable)
            and table.last_promotions >= table.prefetch_min_rows
        )

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> bool:
        """Apply (async) or buffer-then-apply (sync) one trainer's gradients; False if it was a retry."""
        if request_id <= self.last_request.get(trainer, -1):
            self.pushes_dropped += 1
            logger.info(
                "shard %d: dropped retried push %d of trainer %d", self.shard_index, request_id, trainer
            )
            return False
        for name, (ids, grads) in gradients.items():  # validate everything before changing anything
            self._table(name)
            if ids.shape[0] != grads.shape[0]:
                raise ValueError(
                    f"push to table {name!r}: {ids.shape[0]} ids but {grads.shape[0]} gradient rows"
                )
        if self.applies_pushes_at_once:
            self.last_request[trainer] = request_id
            for name, (ids, grads) in gradients.items():
                self._update(name, ids, grads, step)
            self.applied_step = max(self.applied_step, step)
            self.pushes_applied += 1
            return True
        pending = self._pending
        if pending is None:
            pending = self._pending = _PendingStep(step)
        elif pending.step != step:
            raise RuntimeError(
                f"shard {self.shard_index}: trainer {trainer} pushed step {step} while step {pending.step} "
                f"still waits for trainers {sorted(set(range(self.num_trainers)) - pending.trainers)}"
            )
        if trainer in pending.trainers:
            raise RuntimeError(f"shard {self.shard_index}: trainer {trainer} pushed step {step} twice")
        self.last_request[trainer] = request_id
        pending.trainers.add(trainer)
        for name, pair in gradients.items():
            pending.gradients.setdefault(name, []).append(pair)
        if len(pending.trainers) == self.num_trainers:
            self._apply(pending)
        return True

    @property
    def applies_pushes_at_once(self) -> bool:
        """A push is applied as it arrives (async, or one trainer); a sync step of several trainers
        holds each push until the last one's has come."""
        return self.mode == "async" or self.num_trainers == 1

    def _apply(self, pending: _PendingStep) -> None:
        # Trainers are concatenated in trainer order so the float summation order is deterministic.
        for name, pairs in pending.gradients.items():
            ids = np.concatenate([ids for ids, _ in pairs])
            grads = np.concatenate([grads for _, grads in pairs])
            self._update(name, ids, grads, pending.step)
        self.applied_step = pending.step
        self.pushes_applied += len(pending.trainers)
        self._pending = None

    def _update(self, name: str, ids: np.ndarray, grads: np.ndarray, step: int) -> None:
        self.tables[name].push(ids, grads, step=step)
        if self._version_log is not None:
            self._version_log.updated(name, ids)

    def set_num_trainers(self, num_trainers: int) -> None:
        """From the next step on, `num_trainers` trainers' pushes complete a sync step (trainers added
        or removed between steps, `psrec.elastic.trainer_scaling`)."""
        if self._pending is not None:
            raise RuntimeError(
                f"shard {self.shard_index}: the trainer count changed in the middle of step {self._pending.step}"
            )
        if isinstance(num_trainers, bool) or not isinstance(num_trainers, int) or num_trainers < 1:
            raise ValueError(
                f"shard {self.shard_index}: num_trainers must be an integer >= 1, got {num_trainers!r}"
            )
        self.num_trainers = num_trainers

    def set_learning_rate(self, lr: float, tables: list[str] | None = None) -> None:
        for name in tables or list(self.tables):
            self.tables[name].set_learning_rate(lr)

    def evict(self, step: int) -> dict[str, int]:
        return {name: table.evict(step=step) for name, table in self.tables.items()}

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_arrays(self, kind: str) -> dict[str, np.ndarray]:
        """This shard's part of a checkpoint as flat {"table/field": array}: every row ("full") or
        only rows changed and ids removed since the previous checkpoint ("delta")."""
        if self._pending is not None:
            raise RuntimeError(
                f"shard {self.shard_index}: checkpoint requested in the middle of step {self._pending.step}"
            )
        if kind == "delta" and self.needs_full_checkpoint:
            raise RuntimeError(
                f"shard {self.shard_index}: tables were replaced by a snapshot; take a full checkpoint"
            )
        arrays: dict[str, np.ndarray] = {}
        for name, table in self.tables.items():
            marker = table.delta_marker()
            record = table.export_state() if kind == "full" else table.export_delta(self._markers[name])
            arrays.update({f"{name}/{key}": value for key, value in record.to_arrays().items()})
            self._staged_markers[name] = marker
        return arrays

    def confirm_checkpoint(self) -> None:
        """The checkpoint whose arrays were last taken is committed: later deltas start from it."""
        for name, marker in self._staged_markers.items():
            self.tables[name].forget_deltas_before(marker)
            self._markers[name] = marker
        self._staged_markers = {}
        self.needs_full_checkpoint = False

    def restore_arrays(self, chain: list[tuple[str, dict[str, np.ndarray]]], *, step: int) -> None:
        """Rebuild every table from a checkpoint chain [("full", arrays), ("delta", arrays), ...].

        Afterwards the shard expects step `step` next: pushes of earlier steps count as retries.
        """
        if not chain or chain[0][0] != "full":
            raise ValueError(f"shard {self.shard_index}: a restore chain starts with a full checkpoint")
        for kind, arrays in chain:
            per_table: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.tables}
            for key, value in arrays.items():
                name, _, field_name = key.partition("/")
                if name not in per_table:
                    raise ValueError(f"shard {self.shard_index}: checkpoint holds unknown table {name!r}")
                per_table[name][field_name] = value
            for name, table in self.tables.items():
                if not per_table[name]:
                    raise ValueError(f"shard {self.shard_index}: checkpoint has no data for table {name!r}")
                if kind == "full":
                    table.import_state(TableState.from_arrays(per_table[name]))
                else:
                    table.apply_delta(TableDelta.from_arrays(per_table[name]))
        self._markers = {name: table.delta_marker() for name, table in self.tables.items()}
        self._staged_markers = {}
        self.needs_full_checkpoint = False  # the tables are the chain's: a delta from it is whole
        self._pending = None
        self.applied_step = step - 1
        self.last_request = {trainer: step - 1 for trainer in range(self.num_trainers)}

    def save_snapshot(self, tag: str) -> None:
        """Keep an in-memory copy of every table (e.g. the best model so far under early stopping)."""
        self._snapshots[tag] = {name: table.export_state() for name, table in self.tables.items()}

    def restore_snapshot(self, tag: str) -> None:
        for name, state in self._snapshots[tag].items():
            self.tables[name].import_state(state)
        # import_state starts a new delta generation: the next checkpoint must be a full one.
        self._markers = {name: table.delta_marker() for name, table in self.tables.items()}
        self.needs_full_checkpoint = True

    def snapshot_tags(self) -> list[str]:
        return sorted(self._snapshots)

    def snapshot_arrays(self, tag: str) -> dict[str, np.ndarray]:
        """A snapshot as flat {"table/field": array} (to keep it in a file)."""
        return {
            f"{name}/{key}": value
            for name, state in self._snapshots[tag].items()
            for key, value in state.to_arrays().items()
        }

    def load_snapshot_arrays(self, tag: str, arrays: dict[str, np.ndarray]) -> None:
        """Put back a snapshot written by `snapshot_arrays` (the tables themselves are unchanged)."""
        per_table: dict[str, dict[str, np.ndarray]] = {}
        for key, value in arrays.items():
            name, _, field_name = key.partition("/")
            self._table(name)
            per_table.setdefault(name, {})[field_name] = value
        self._snapshots[tag] = {name: TableState.from_arrays(fields) for name, fields in per_table.items()}

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every table's (ids, float32 rows), for inspection and tests (checkpoints use export_state)."""
        out = {}
        for name, table in self.tables.items():
            ids = table.export_state().ids
            out[name] = (ids, table.pull(ids, train=False))
        return out

    def stats(self) -> dict[str, dict[str, int]]:
        """Per table: rows, the bytes its rows in memory take (`EmbeddingTable.row_bytes`), bytes in
        memory and, for a table with a disk tier, rows and bytes per tier and the traffic between them
        (`TieredTable.tier_stats`). Counts only: they sum over shards."""
        stats = {}
        for name, table in self.tables.items():
            stats[name] = {"rows": table.num_rows, "row_bytes": table.row_bytes(), **table.memory_bytes()}
            if isinstance(table, TieredTable):
                stats[name].update(table.tier_stats())
        return stats

    def _table(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise KeyError(
                f"shard {self.shard_index} has no table {name!r}; tables: {sorted(self.tables)}"
            ) from None
