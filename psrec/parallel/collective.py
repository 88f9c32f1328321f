"""Collective embedding sharding: the trainers hold the tables themselves and swap ids and rows by all-to-all.

Instead of PS actors, every trainer (rank) keeps a `ParameterShard` with its part of every table:
whole tables (table-wise) or the rows of its virtual buckets (row-wise), as a `Placement` says.
`CollectiveConnection` is a `ShardConnection`, so the trainer keeps the unchanged `EmbeddingClient`
(plan -> pull -> embed -> push), the `StepRunner`, and the shard's checkpoint/snapshot calls; the
client is built over this one connection with an all-zero bucket map (one logical shard), and the
connection does the physical route -> compute -> return across ranks:

pull (one exchange for all tables of the batch):
  1. route: each table's unique ids -> owning rank (`Placement.route`);
  2. all-to-all the per-(rank, table) counts, then the ids;
  3. compute: serve every source rank's ids from the local shard (`ParameterShard.pull`, one call
     per source rank, like one PS pull per trainer);
  4. all-to-all the rows back and `gather` them into batch order.

push: route the row gradients the same way, all-to-all counts, ids and gradients; the owner hands
each source rank's gradients to its local shard as that trainer's push (`ParameterShard.push`,
``num_trainers = world size``, sync mode), which applies a step's gradients of all ranks together,
once: the same sparse-optimizer semantics as the PS in sync mode, so W ranks with batch b equal one
process with batch W*b (`tests/parallel/test_collective.py` checks it).

Collectives must be entered by every rank in the same order, so the exchanges are lazy: `pull` and
`push` only queue the request, and the first `result()` runs the queued exchanges in order. In the
step loop (sync mode) every rank then runs, per step: pull exchange at `collect_pull`, push exchange
at the push's `result()`. A rank without a batch in a step only pushes (`submit_empty_push`): before
such a push the connection runs an empty pull exchange so that it meets the other ranks' pulls.
Evaluation must run in lockstep too: iterate the eval batches through `lockstep_batches`, which
makes a rank that is out of batches call `idle_pull()` while any other rank still pulls. Async mode (staleness > 0) is not supported.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from psrec.data.batch import Batch
from psrec.parallel.exchange import all_to_all_flat, exchange_counts, world_size
from psrec.parallel.row_owners import Placement
from psrec.ps.client import LINEAR_SUFFIX, EmbeddingClient, Pending
from psrec.ps.shard import ParameterShard, TableGradients

logger = logging.getLogger(__name__)


@dataclass
class _Operation:
    kind: str  # "pull" | "push"
    payload: Any
    train: bool = True
    step: int = 0
    request_id: int = 0
    done: bool = False
    value: Any = None


@dataclass
class _Handle:
    connection: CollectiveConnection
    operation: _Operation

    def result(self) -> Any:
        self.connection._run_until(self.operation)
        return self.operation.value


class CollectiveConnection:
    """This rank's side of collective sharding (see the module docstring).

    `shard` holds this rank's partition of every table and must be built with
    ``num_trainers=world_size, mode="sync"``; `table_dims` lists every table (linear companions
    included) in the same order on every rank.
    """

    def __init__(
        self,
        shard: ParameterShard,
        placement: Placement,
        *,
        table_dims: dict[str, int],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.shard = shard
        self.placement = placement
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = world_size(group)
        if self.world_size != placement.num_ranks:
            raise ValueError(
                f"placement is for {placement.num_ranks} ranks but the process group has {self.world_size}"
            )
        if shard.mode != "sync" or shard.num_trainers != self.world_size:
            raise ValueError(
                f"collective sharding needs a sync shard with num_trainers={self.world_size}, got "
                f"mode={shard.mode!r}, num_trainers={shard.num_trainers}"
            )
        missing = sorted(set(table_dims) - set(shard.tables))
        if missing:
            raise ValueError(f"shard has no tables {missing}")
        self.tables = sorted(table_dims)
        self.table_dims = dict(table_dims)
        self._queue: deque[_Operation] = deque()
        self._train_pull_queued = False
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- ShardConnection ---------------------------------------------------------------------
    def pull(self, requests: dict[str, np.ndarray], *, train: bool, request: int | None = None) -> Pending:
        unknown = sorted(set(requests) - set(self.table_dims))
        if unknown:
            raise KeyError(f"pull of unknown tables {unknown}; tables: {self.tables}")
        operation = _Operation("pull", requests, train=train)
        self._queue.append(operation)
        self._train_pull_queued = self._train_pull_queued or train
        return _Handle(self, operation)

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending:
        if trainer != self.rank:
            raise ValueError(f"rank {self.rank} pushes as trainer {trainer}: trainer index must be the rank")
        unknown = sorted(set(gradients) - set(self.table_dims))
        if unknown:
            raise KeyError(f"push to unknown tables {unknown}; tables: {self.tables}")
        if not self._train_pull_queued:  # an empty step: meet the other ranks' pull exchange first
            self._queue.append(_Operation("pull", {}, train=True))
        self._train_pull_queued = False
        operation = _Operation("push", gradients, step=step, request_id=request_id)
        self._queue.append(operation)
        return _Handle(self, operation)

    def idle_pull(self, *, train: bool = False) -> None:
        """Take part in a pull exchange with no ids (a rank out of batches while others still pull)."""
        self.pull({}, train=train).result()

    # -- machinery ---------------------------------------------------------------------------
    def _run_until(self, operation: _Operation) -> None:
        while not operation.done:
            current = self._queue.popleft()
            if current.kind == "pull":
                current.value = self._exchange_pull(current.payload, train=current.train)
            else:
                current.value = self._exchange_push(current.payload, current.step, current.request_id)
            current.done = True

    def _route(self, arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any], np.ndarray]:
        """Per table, the routed ids; and counts (W, T + 1): ids per (rank, table), then a flag column."""
        routed = {name: self.placement.route(name, ids) for name, ids in arrays.items()}
        counts = np.zeros((self.world_size, len(self.tables) + 1), dtype=np.int64)
        for column, name in enumerate(self.tables):
            if name in routed:
                counts[:, column] = [part.size for part in routed[name].ids_per_shard]
        return routed, counts

    def _exchange_ids(
        self, routed: dict[str, Any], counts: np.ndarray
    ) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        """Counts and ids to their owners; returns received counts and, per source rank, its ids per table."""
        received_counts = exchange_counts(counts, self.group)
        parts = [
            np.concatenate(
                [routed[name].ids_per_shard[rank] for name in self.tables if name in routed]
                or [np.zeros(0, np.int64)]
            ).astype(np.int64, copy=False)
            for rank in range(self.world_size)
        ]
        sizes = [int(row[:-1].sum()) for row in received_counts]
        received = all_to_all_flat(parts, sizes, self.group)
        self.bytes_sent += sum(p.nbytes for p in parts) - parts[self.rank].nbytes
        self.bytes_received += sum(r.nbytes for r in received) - received[self.rank].nbytes
        per_source = [
            self._split_by_table(received[r], received_counts[r], 1) for r in range(self.world_size)
        ]
        return received_counts, per_source

    def _split_by_table(
        self, flat: np.ndarray, counts: np.ndarray, width: int | None
    ) -> dict[str, np.ndarray]:
        """A flat per-rank message -> {table: array}; `width` None means each table's dim (rows)."""
        out, offset = {}, 0
        for column, name in enumerate(self.tables):
            n = int(counts[column])
            if n:
                dim = self.table_dims[name] if width is None else width
                out[name] = flat[offset : offset + n * dim].reshape((n, dim) if width is None else (n,))
                offset += n * dim
        return out

    def _flatten_rows(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        parts = [rows[name].reshape(-1) for name in self.tables if name in rows]
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)

    def _exchange_values(
        self, outgoing: list[dict[str, np.ndarray]], incoming_counts: np.ndarray
    ) -> list[dict[str, np.ndarray]]:
        """Row-shaped float32 values per (rank, table) out; the mirror-image values in."""
        parts = [self._flatten_rows(values) for values in outgoing]
        dims = np.array([self.table_dims[name] for name in self.tables], dtype=np.int64)
        sizes = [int((row[:-1] * dims).sum()) for row in incoming_counts]
        received = all_to_all_flat(parts, sizes, self.group)
        self.bytes_sent += sum(p.nbytes for p in parts) - parts[self.rank].nbytes
        self.bytes_received += sum(r.nbytes for r in received) - received[self.rank].nbytes
        return [self._split_by_table(received[r], incoming_counts[r], None) for r in range(self.world_size)]

    def _exchange_pull(self, requests: dict[str, np.ndarray], *, train: bool) -> dict[str, np.ndarray]:
        routed, counts = self._route(requests)
        counts[:, -1] = int(train)
        received_counts, asked = self._exchange_ids(routed, counts)
        # compute: serve each source rank's ids as that trainer's pull, in rank order
        served = [
            self.shard.pull(asked[source], train=bool(received_counts[source, -1]))
            for source in range(self.world_size)
        ]
        replies = self._exchange_values(served, counts)
        rows = {}
        for name, table_routed in routed.items():
            empty = np.zeros((0, self.table_dims[name]), np.float32)
            rows[name] = table_routed.gather([replies[r].get(name, empty) for r in range(self.world_size)])
        return rows

    def _exchange_push(self, gradients: TableGradients, step: int, request_id: int) -> bool:
        routed, counts = self._route({name: ids for name, (ids, _) in gradients.items()})
        received_counts, ids_from = self._exchange_ids(routed, counts)
        outgoing: list[dict[str, np.ndarray]] = [{} for _ in range(self.world_size)]
        for name, (_, grads) in gradients.items():
            for rank, part in enumerate(routed[name].split(grads)):
                if part.shape[0]:
                    outgoing[rank][name] = part
        grads_from = self._exchange_values(outgoing, received_counts)
        applied = True
        for source in range(self.world_size):  # every rank's push, in rank order: sync applies once
            pushed = {name: (ids_from[source][name], grads_from[source][name]) for name in ids_from[source]}
            applied = self.shard.push(source, request_id, step, pushed) and applied
        return applied


def lockstep_batches(batches: Iterable[Batch], connection: CollectiveConnection) -> Iterator[Batch]:
    """This rank's batches, kept in step with the other ranks' pull exchanges (evaluation).

    Ranks' shares of a split may differ by a batch. Before each batch the ranks agree whether any
    still has one; a rank that is out takes part in that round's pull exchange with no ids. Use one
    pull per yielded batch (e.g. `StepRunner.predict`).
    """
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        if connection.world_size > 1:
            flag = torch.tensor([batch is not None], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=connection.group)
            if not flag.item():
                return
            if batch is None:
                connection.idle_pull(train=False)
                continue
        elif batch is None:
            return
        yield batch


def collective_client(
    connection: CollectiveConnection, *, linear_terms: bool = False, num_buckets: int = 1024
) -> EmbeddingClient:
    """The unchanged `EmbeddingClient` over one collective connection (one logical shard)."""
    return EmbeddingClient(
        [connection],
        np.zeros(num_buckets, dtype=np.int64),
        table_dims={n: d for n, d in connection.table_dims.items() if not n.endswith(LINEAR_SUFFIX)},
        linear_terms=linear_terms,
        trainer_index=connection.rank,
    )
