"""The trainer-side parameter-server client: route -> compute -> return, on plain arrays.

For one batch's ids the client

1. **routes** (`route`): per table, the ids (all features that share the table together) are
   deduplicated and grouped by owning shard through the virtual-bucket map, in one numba pass
   (`psrec.ps.routing.dedup_and_route`);
2. **pulls** (`submit_pull` / `collect_pull`): every shard is asked for its unique ids in parallel,
   and the replies are gathered back into one (num_unique, dim) array per table;
3. **pushes** (`submit_push`): each table's row gradients are split by shard and sent.

It knows tables, ids, rows and gradients only: what a batch's features are and how rows become a
model's input is the trainer's business (`BatchLookup`, in the train layer). The same code serves in-process
shards (`LocalConnection`: no Ray, no copies) and Ray actors (`psrec.ps.actors.RayConnection`).

    client = EmbeddingClient([LocalConnection(shard)], bucket_map, table_dims={"t": 8})
    routing, inverse, starts = client.route(ids, table_starts=np.array([0, ids.size]), tables=["t"])
    pulled = client.pull(routing)        # pulled.rows["t"][inverse] are the rows of `ids`
    client.push(routing, {"t": grads}.get, step=0)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from psrec.allocator import ReusableBuffers
from psrec.ps.routing import Routed, dedup_and_route, route
from psrec.ps.shard import ParameterShard, TableGradients
from psrec.ps.wire import check_precision, decode_rows, encode_gradients

LINEAR_SUFFIX = "__linear"


def linear_table_name(table: str) -> str:
    """Name of the dim-1 companion table holding first-order (wide) weights of `table`'s ids."""
    return table + LINEAR_SUFFIX


class Pending(Protocol):
    def result(self) -> Any: ...


class ShardConnection(Protocol):
    """How a client talks to one shard; calls return at once and `result()` waits."""

    def pull(self, requests: dict[str, np.ndarray], *, train: bool, request: int | None = None) -> Pending:
        """`request`: a training pull's number in its caller's sequence (the step it serves, plus
        one); a shard that logs its operations answers a repeat from its first reply."""
        ...

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending: ...


@dataclass(frozen=True)
class _Done:
    value: Any

    def result(self) -> Any:
        return self.value


class LocalConnection:
    """A shard living in this process: calls run immediately, and a pull can write its rows straight
    into the caller's arrays (`out`, e.g. slices of the client's fused buffer: no copy)."""

    def __init__(self, shard: ParameterShard) -> None:
        self.shard = shard

    def pull(
        self,
        requests: dict[str, np.ndarray],
        *,
        train: bool,
        request: int | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> Pending:
        return _Done(self.shard.pull(requests, train=train, out=out))

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending:
        return _Done(self.shard.push(trainer, request_id, step, gradients))

    def prefetch(self, requests: dict[str, np.ndarray]) -> int:
        return self.shard.prefetch(requests)


@runtime_checkable
class Prefetching(Protocol):
    """A connection whose shard can be told a coming training pull's ids (`ParameterShard.prefetch`);
    returns the rows it is reading, 0 where that is not known without waiting."""

    def prefetch(self, requests: dict[str, np.ndarray]) -> int: ...


@dataclass(frozen=True)
class RoutedIds:
    """The route step's result: each table's unique ids, grouped by owning shard.

    Every table's unique ids are grouped by shard (`Routed.order` is None), so pulled rows and pushed
    gradients move per shard as contiguous slices. With `fused`, the tables' rows are pulled into ONE
    buffer, tables back to back, `spans` giving each table's rows (all tables then have one dim).
    """

    unique_ids: dict[str, np.ndarray]
    routed: dict[str, Routed]
    spans: dict[str, tuple[int, int]]  # table -> its rows among all tables' unique ids
    fused: bool = False
    version: int = 0  # of the bucket map it was routed with (`EmbeddingClient.set_routing`)


@dataclass
class PullRequest:
    """A submitted pull: one pending reply per shard, and the fused buffers (see `RoutedIds`) that
    in-process shards already write into."""

    handles: list[Pending]
    fused: dict[str, np.ndarray] = field(default_factory=dict)  # "rows" / "linear" -> fused buffer
    in_place: set[tuple[int, str]] = field(default_factory=set)  # (shard, table) written into `fused`
    routing: RoutedIds | None = None  # the routing it was sent with (`EmbeddingClient.current`)


@dataclass
class PulledRows:
    routing: RoutedIds
    rows: dict[str, np.ndarray]  # table -> (num_unique, dim) float32 (views of `fused` when fused)
    pull_bytes: int = 0
    fused: dict[str, np.ndarray] = field(default_factory=dict)  # "rows" / "linear" -> fused buffer


def _grouped(routing: RoutedIds) -> bool:
    """Whether every table's unique ids are grouped by shard (a batch routed with the current map)."""
    return all(routed.order is None for routed in routing.routed.values())


def fused_key(table: str) -> str:
    """The fused buffer a table's rows live in: "linear" for linear companions, else "rows"."""
    return "linear" if table.endswith(LINEAR_SUFFIX) else "rows"


class EmbeddingClient:
    """Route ids, pull their rows, push their gradients (see the module docstring)."""

    def __init__(
        self,
        connections: list[ShardConnection],
        bucket_to_shard: np.ndarray,
        *,
        table_dims: dict[str, int],
        linear_terms: bool = False,
        trainer_index: int = 0,
        wire_precision: str = "fp32",
        routing_version: int = 0,
        prefetch_tables: Collection[str] = (),
    ) -> None:
        check_precision(wire_precision)
        self.connections: list[ShardConnection] = []
        self._routing: tuple[int, np.ndarray] = (0, np.zeros(0, np.int64))
        self.set_routing(connections, bucket_to_shard, version=routing_version)
        self.table_dims = dict(table_dims)
        self.linear_terms = linear_terms
        self.trainer_index = trainer_index
        self.wire_precision = wire_precision  # of pushed gradients; shards encode pulled rows (psrec.ps.wire)
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self._fused_buffers = ReusableBuffers()  # each pull's fused rows, reused once released
        # Tables with a disk tier: their shards are told each coming training pull's ids (`prefetch`).
        self.prefetch_tables = frozenset(prefetch_tables)

    # -- route -------------------------------------------------------------------------------
    def set_routing(
        self, connections: list[ShardConnection], bucket_to_shard: np.ndarray, *, version: int
    ) -> None:
        """Route with `bucket_to_shard` over `connections` from now on (between steps: no call in
        flight). Batches routed before with an older version are routed again when sent (`current`)."""
        if int(bucket_to_shard.max()) + 1 != len(connections):
            raise ValueError(
                f"bucket map names {int(bucket_to_shard.max()) + 1} shards but {len(connections)} are connected"
            )
        bucket_map = np.ascontiguousarray(bucket_to_shard, dtype=np.int64)
        self.connections = list(connections)
        self._routing = (version, bucket_map)  # one assignment: the planner thread reads it whole

    @property
    def bucket_to_shard(self) -> np.ndarray:
        return self._routing[1]

    @property
    def routing_version(self) -> int:
        return self._routing[0]

    def current(self, routing: RoutedIds) -> RoutedIds:
        """`routing`, or the same unique ids (same order, so the batch's `inverse` still holds) routed
        again with the current bucket map when it was routed with an older one (a batch the planner
        routed before the map changed)."""
        version, bucket_map = self._routing
        if routing.version == version:
            return routing
        routed = {name: route(ids, bucket_map) for name, ids in routing.unique_ids.items()}
        return replace(routing, routed=routed, version=version)

    def route(
        self,
        ids: np.ndarray,
        *,
        table_starts: np.ndarray,
        tables: Sequence[str],
        sample_major: tuple[int, np.ndarray] | None = None,
    ) -> tuple[RoutedIds, np.ndarray, np.ndarray]:
        """Dedup and route `ids`, where table t's ids are ``ids[table_starts[t]:table_starts[t + 1]]``.

        Returns the routing, the position of every id among all tables' unique ids (``inverse``,
        sample-major when `sample_major` = (batch size, block order) is given: then the rows are
        pulled fused) and the start of each table's unique ids in that numbering.
        """
        version, bucket_map = self._routing
        unique, inverse, unique_starts, counts = dedup_and_route(
            ids, table_starts, bucket_map, sample_major=sample_major
        )
        splits = np.zeros((len(tables), counts.shape[1] + 1), dtype=np.int64)
        np.cumsum(counts, axis=1, out=splits[:, 1:])
        unique_ids: dict[str, np.ndarray] = {}
        routed: dict[str, Routed] = {}
        spans: dict[str, tuple[int, int]] = {}
        for t, name in enumerate(tables):
            start, stop = int(unique_starts[t]), int(unique_starts[t + 1])
            table_ids = unique_ids[name] = unique[start:stop]
            bounds = splits[t]
            routed[name] = Routed(
                [table_ids[bounds[s] : bounds[s + 1]] for s in range(counts.shape[1])], None, bounds
            )
            spans[name] = (start, stop)
        return RoutedIds(unique_ids, routed, spans, sample_major is not None, version), inverse, unique_starts

    def tables_of(self, routing: RoutedIds) -> list[tuple[str, str]]:
        """(table to pull, table whose routing/ids it uses); linear companions reuse their table's ids."""
        pairs = [(table, table) for table in routing.unique_ids]
        if self.linear_terms:
            pairs += [(linear_table_name(table), table) for table in routing.unique_ids]
        return pairs

    # -- compute (remote) --------------------------------------------------------------------
    def submit_pull(
        self, routing: RoutedIds, *, train: bool = True, request: int | None = None
    ) -> PullRequest:
        """Send every shard its ids; returns at once (prefetch keeps the request). `request`: the
        training pull's number (`ShardConnection.pull`)."""
        routing = self.current(routing)
        pairs = self.tables_of(routing)
        pulled = PullRequest([], routing=routing)
        if routing.fused:
            total = sum(ids.size for ids in routing.unique_ids.values())
            pulled.fused["rows"] = self._fused_buffers.empty(
                (total, self.table_dims[next(iter(routing.unique_ids))]), np.float32
            )
            if self.linear_terms:
                pulled.fused["linear"] = np.empty((total, 1), np.float32)
        for shard, connection in enumerate(self.connections):
            requests = {
                name: routing.routed[source].ids_per_shard[shard]
                for name, source in pairs
                if routing.routed[source].ids_per_shard[shard].size
            }
            if pulled.fused and isinstance(connection, LocalConnection) and _grouped(routing):
                # Each table's ids are grouped by shard (`Routed.order` None): this shard's rows
                # have their own slice of the table's span in the fused buffer.
                out = {}
                for name, source in pairs:
                    if name in requests:
                        first = routing.spans[source][0]
                        bounds = routing.routed[source].splits
                        buffer = pulled.fused[fused_key(name)]
                        out[name] = buffer[first + bounds[shard] : first + bounds[shard + 1]]
                        pulled.in_place.add((shard, name))
                pulled.handles.append(connection.pull(requests, train=train, out=out))
            else:
                pulled.handles.append(connection.pull(requests, train=train, request=request))
        return pulled

    def prefetch(self, routing: RoutedIds) -> int:
        """Tell the shards the ids of a coming training pull in the `prefetch_tables` (those with a
        disk tier), so that they read its cold rows ahead (`ParameterShard.prefetch`) while the
        caller computes; changes no result. Returns the rows in-process shards are reading (a shard
        actor is not waited for). A connection without `prefetch` is not told."""
        if not self.prefetch_tables:
            return 0
        routing = self.current(routing)
        pairs = [(name, source) for name, source in self.tables_of(routing) if name in self.prefetch_tables]
        reading = 0
        for shard, connection in enumerate(self.connections):
            requests = {
                name: routing.routed[source].ids_per_shard[shard]
                for name, source in pairs
                if routing.routed[source].ids_per_shard[shard].size
            }
            if requests and isinstance(connection, Prefetching):
                reading += connection.prefetch(requests)
        return reading

    def collect_pull(self, routing: RoutedIds, request: PullRequest) -> PulledRows:
        routing = request.routing or routing
        replies = [handle.result() for handle in request.handles]
        fused = request.fused
        rows: dict[str, np.ndarray] = {}
        nbytes = 0
        for name, source in self.tables_of(routing):
            routed = routing.routed[source]
            dim = 1 if name.endswith(LINEAR_SUFFIX) else self.table_dims[name]
            empty = np.zeros((0, dim), np.float32)
            parts = [reply.get(name, empty) for reply in replies]
            nbytes += sum(part.nbytes for part in parts)
            buffer = fused.get(fused_key(name))
            if buffer is None:
                rows[name] = routed.gather([decode_rows(part) for part in parts])
                continue
            start, stop = routing.spans[source]
            rows[name] = buffer[start:stop]
            for shard, part in enumerate(parts):
                if (shard, name) not in request.in_place and part.shape[0]:
                    span = slice(routed.splits[shard], routed.splits[shard + 1])
                    where = span if routed.order is None else routed.order[span]
                    rows[name][where] = decode_rows(part)
        self.bytes_pulled += nbytes
        return PulledRows(routing, rows, nbytes, fused)

    def pull(self, routing: RoutedIds, *, train: bool = True) -> PulledRows:
        return self.collect_pull(routing, self.submit_pull(routing, train=train))

    # -- return ------------------------------------------------------------------------------
    def submit_push(
        self,
        routing: RoutedIds,
        gradient_of: Callable[[str], np.ndarray | None],
        *,
        step: int,
        scale: float = 1.0,
    ) -> list[Pending]:
        """Send each shard the gradients of its rows (multiplied by `scale`, e.g. 1/num_trainers).

        ``gradient_of(table)`` is the table's (num_unique, dim) row gradients in the routing's order,
        None when it got none (zeros are pushed then). The step doubles as the push's request id: a
        step re-run after a crash carries the same id, and a shard that already applied it drops the
        retry.
        """
        routing = self.current(routing)
        per_shard: list[TableGradients] = [{} for _ in self.connections]
        for name, source in self.tables_of(routing):
            grad_np = gradient_of(name)
            routed = routing.routed[source]
            if grad_np is None:
                dim = 1 if name.endswith(LINEAR_SUFFIX) else self.table_dims[name]
                grad_np = np.zeros((int(routed.splits[-1]), dim), np.float32)
            if scale != 1.0:
                grad_np = grad_np * np.float32(scale)
            for shard, part in enumerate(routed.split(grad_np)):
                if part.shape[0]:
                    encoded = encode_gradients(np.ascontiguousarray(part), self.wire_precision)
                    per_shard[shard][name] = (routed.ids_per_shard[shard], encoded)  # type: ignore[assignment]
        handles = []
        for connection, gradients in zip(self.connections, per_shard, strict=True):
            self.bytes_pushed += sum(ids.nbytes + grads.nbytes for ids, grads in gradients.values())
            # Every shard gets the push, even an empty one: in sync mode it completes the step.
            handles.append(connection.push(self.trainer_index, step, step, gradients))
        return handles

    def submit_empty_push(self, *, step: int) -> list[Pending]:
        """A push with no gradients: completes a sync step for a trainer that had no batch."""
        return [connection.push(self.trainer_index, step, step, {}) for connection in self.connections]

    def push(
        self,
        routing: RoutedIds,
        gradient_of: Callable[[str], np.ndarray | None],
        *,
        step: int,
        scale: float = 1.0,
    ) -> None:
        for handle in self.submit_push(routing, gradient_of, step=step, scale=scale):
            handle.result()
