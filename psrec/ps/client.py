"""The trainer-side embedding client: route -> compute -> return, for local or remote shards.

For one batch the client

1. **plans** (`plan`): per table, the batch's ids are deduplicated (all features that share the
   table together) and routed to their owning shards by virtual bucket;
2. **pulls** (`pull`): every shard is asked for its unique ids in parallel, and the replies are
   gathered back into one (num_unique, dim) array per table;
3. **embeds** (`embed`): the unique rows become leaf tensors with `requires_grad`, and the model's
   input is built from them with PyTorch ops (`embedding_bag` sum pooling per feature, indexing
   for sequences), so autograd produces one gradient row per unique id;
4. **pushes** (`push`): after backward, each table's row gradients are split by shard and sent.

The same code serves in-process shards (`LocalConnection`, no Ray: debugging, unit tests, the
in-process runtime) and Ray actors (`psrec.ps.actors.RayConnection`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from psrec.data.batch import Batch
from psrec.models.base import ModelInput
from psrec.ps.routing import Routed, route
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

    def pull(self, requests: dict[str, np.ndarray], *, train: bool) -> Pending: ...

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending: ...


@dataclass(frozen=True)
class _Done:
    value: Any

    def result(self) -> Any:
        return self.value


class LocalConnection:
    """A shard living in this process: calls run immediately."""

    def __init__(self, shard: ParameterShard) -> None:
        self.shard = shard

    def pull(self, requests: dict[str, np.ndarray], *, train: bool) -> Pending:
        return _Done(self.shard.pull(requests, train=train))

    def push(self, trainer: int, request_id: int, step: int, gradients: TableGradients) -> Pending:
        return _Done(self.shard.push(trainer, request_id, step, gradients))


@dataclass(frozen=True)
class _FeatureIndex:
    name: str
    table: str
    inverse: np.ndarray  # positions into the table's unique ids
    offsets: np.ndarray | None  # (B,) bag starts for pooled features; None for sequences
    mask: np.ndarray | None  # (B, L) for sequences
    single_valued: bool = False  # a pooled feature with exactly one id per sample


@dataclass(frozen=True)
class LookupPlan:
    """Route step of one batch: unique ids per table, their shards, and per-feature indices."""

    unique_ids: dict[str, np.ndarray]
    routed: dict[str, Routed]
    pooled: list[_FeatureIndex]
    sequences: list[_FeatureIndex]
    batch_size: int

    def num_ids(self) -> int:
        return sum(ids.size for ids in self.unique_ids.values())


@dataclass
class PulledRows:
    plan: LookupPlan
    rows: dict[str, np.ndarray]  # table -> (num_unique, dim) float32
    pull_bytes: int = 0


class EmbeddingClient:
    """Pull rows for a batch, build the model input, push row gradients (see the module docstring)."""

    def __init__(
        self,
        connections: list[ShardConnection],
        bucket_to_shard: np.ndarray,
        *,
        table_dims: dict[str, int],
        feature_tables: dict[str, str],
        sequence_tables: dict[str, str] | None = None,
        linear_terms: bool = False,
        trainer_index: int = 0,
        wire_precision: str = "fp32",
    ) -> None:
        check_precision(wire_precision)
        if int(bucket_to_shard.max()) + 1 != len(connections):
            raise ValueError(
                f"bucket map names {int(bucket_to_shard.max()) + 1} shards but {len(connections)} are connected"
            )
        self.connections = connections
        self.bucket_to_shard = bucket_to_shard
        self.table_dims = dict(table_dims)
        self.feature_tables = dict(feature_tables)
        self.sequence_tables = dict(sequence_tables or {})
        self.linear_terms = linear_terms
        self.trainer_index = trainer_index
        self.wire_precision = wire_precision  # of pushed gradients; shards encode pulled rows (psrec.ps.wire)
        self.bytes_pulled = 0
        self.bytes_pushed = 0

    # -- route -------------------------------------------------------------------------------
    def plan(self, batch: Batch) -> LookupPlan:
        per_table: dict[str, list[np.ndarray]] = {}
        pending_features: list[tuple[str, str, int, int, np.ndarray | None, np.ndarray | None]] = []
        ids: np.ndarray
        sizes: dict[str, int] = {}
        b = batch.batch_size
        for key in batch.sparse.keys:
            table = self._feature_table(key)
            ids, lengths = batch.sparse.feature(key)
            offsets = np.zeros(b, dtype=np.int64)
            np.cumsum(lengths[:-1], out=offsets[1:])
            start = sizes.get(table, 0)
            per_table.setdefault(table, []).append(ids)
            sizes[table] = start + ids.size
            pending_features.append((key, table, start, ids.size, offsets, None))
        for key, sequence in batch.sequences.items():
            if key not in self.sequence_tables:
                raise KeyError(
                    f"sequence {key!r} is not mapped to a table; mapped: {sorted(self.sequence_tables)}"
                )
            table = self.sequence_tables[key]
            ids = sequence.ids[sequence.mask].astype(np.int64, copy=False)
            start = sizes.get(table, 0)
            per_table.setdefault(table, []).append(ids)
            sizes[table] = start + ids.size
            pending_features.append((key, table, start, ids.size, None, sequence.mask))
        unique_ids: dict[str, np.ndarray] = {}
        inverses: dict[str, np.ndarray] = {}
        for table, parts in per_table.items():
            all_ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
            unique_ids[table], inverses[table] = np.unique(all_ids, return_inverse=True)
        pooled: list[_FeatureIndex] = []
        sequences: list[_FeatureIndex] = []
        for key, table, start, size, bag_offsets, mask in pending_features:
            single = (
                mask is None
                and size == b
                and bag_offsets is not None
                and bool((np.diff(bag_offsets) == 1).all())
            )
            index = _FeatureIndex(
                key, table, inverses[table][start : start + size], bag_offsets, mask, single
            )
            (pooled if mask is None else sequences).append(index)
        routed = {table: route(ids, self.bucket_to_shard) for table, ids in unique_ids.items()}
        return LookupPlan(unique_ids, routed, pooled, sequences, b)

    def _feature_table(self, key: str) -> str:
        try:
            return self.feature_tables[key]
        except KeyError:
            raise KeyError(
                f"feature {key!r} is not mapped to a table; mapped: {sorted(self.feature_tables)}"
            ) from None

    def _tables_of(self, plan: LookupPlan) -> list[tuple[str, str]]:
        """(table to pull, table whose routing/ids it uses); linear companions reuse their table's ids."""
        pairs = [(table, table) for table in plan.unique_ids]
        if self.linear_terms:
            pairs += [(linear_table_name(table), table) for table in plan.unique_ids]
        return pairs

    # -- compute (remote) --------------------------------------------------------------------
    def submit_pull(self, plan: LookupPlan, *, train: bool = True) -> list[Pending]:
        """Send every shard its ids; returns at once (prefetch keeps the handles)."""
        pairs = self._tables_of(plan)
        handles = []
        for shard, connection in enumerate(self.connections):
            requests = {
                name: plan.routed[source].ids_per_shard[shard]
                for name, source in pairs
                if plan.routed[source].ids_per_shard[shard].size
            }
            handles.append(connection.pull(requests, train=train))
        return handles

    def collect_pull(self, plan: LookupPlan, handles: list[Pending]) -> PulledRows:
        replies = [handle.result() for handle in handles]
        rows: dict[str, np.ndarray] = {}
        nbytes = 0
        for name, source in self._tables_of(plan):
            routed = plan.routed[source]
            dim = 1 if name.endswith(LINEAR_SUFFIX) else self.table_dims[name]
            empty = np.zeros((0, dim), np.float32)
            parts = [reply.get(name, empty) for reply in replies]
            nbytes += sum(part.nbytes for part in parts)
            rows[name] = routed.gather([decode_rows(part) for part in parts])
        self.bytes_pulled += nbytes
        return PulledRows(plan, rows, nbytes)

    def pull(self, plan: LookupPlan, *, train: bool = True) -> PulledRows:
        return self.collect_pull(plan, self.submit_pull(plan, train=train))

    # -- model input -------------------------------------------------------------------------
    def embed(
        self, pulled: PulledRows, dense: np.ndarray, *, requires_grad: bool = True
    ) -> tuple[ModelInput, dict[str, torch.Tensor]]:
        """Build the model input from pulled rows; returns it and the leaf row tensors (for `push`)."""
        plan = pulled.plan
        weights = {
            name: torch.from_numpy(rows).requires_grad_(requires_grad) for name, rows in pulled.rows.items()
        }
        if plan.pooled:
            pooled = self._pool(weights, plan.pooled, plan.batch_size, lambda table: table)  # (B, F, D)
        else:  # sequence-only models (SASRec)
            dim = next(iter(self.table_dims.values()), 1)
            pooled = torch.zeros(plan.batch_size, 0, dim)
        linear = None
        if self.linear_terms:
            linear = self._pool(weights, plan.pooled, plan.batch_size, linear_table_name).squeeze(
                -1
            )  # (B, F)
        sequences, masks = {}, {}
        for f in plan.sequences:
            assert f.mask is not None
            sequences[f.name] = self._sequence(weights[f.table], f)
            masks[f.name] = torch.from_numpy(f.mask)
        return ModelInput(
            torch.from_numpy(np.require(dense, requirements="W")), pooled, linear, sequences, masks
        ), weights

    @staticmethod
    def _pool(
        weights: dict[str, torch.Tensor],
        features: list[_FeatureIndex],
        batch_size: int,
        table_of: Callable[[str], str],
    ) -> torch.Tensor:
        """Sum-pool every feature: (B, F, D).

        When every feature has exactly one id per sample (the common CTR case) pooling is a gather:
        ONE index into the tables' rows concatenated, whose backward is an index_add. That measured
        2x faster than one embedding_bag per feature (26 features, batch 2048, dim 16), and 3x
        faster than a single fused embedding_bag, whose backward sorts all the indices. Multi-valued
        features use embedding_bag. Gradients reach each table's own leaf tensor either way.
        """
        if all(f.single_valued for f in features):
            names = list(dict.fromkeys(table_of(f.table) for f in features))
            sizes = [weights[name].shape[0] for name in names]
            row_starts = dict(zip(names, np.cumsum([0, *sizes[:-1]]), strict=True))
            fused = torch.cat([weights[name] for name in names]) if len(names) > 1 else weights[names[0]]
            indices = np.concatenate([f.inverse + row_starts[table_of(f.table)] for f in features])
            gathered = fused.index_select(0, torch.from_numpy(indices))  # (F * B, D); backward: index_add
            return gathered.view(len(features), batch_size, -1).transpose(0, 1)
        pooled = []
        for f in features:
            weight = weights[table_of(f.table)]
            inverse = torch.from_numpy(f.inverse)
            if f.single_valued:
                pooled.append(weight.index_select(0, inverse))
            else:
                assert f.offsets is not None
                pooled.append(F.embedding_bag(inverse, weight, torch.from_numpy(f.offsets), mode="sum"))
        return torch.stack(pooled, dim=1)

    @staticmethod
    def _sequence(weight: torch.Tensor, feature: _FeatureIndex) -> torch.Tensor:
        assert feature.mask is not None
        b, length = feature.mask.shape
        padded = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])  # padding -> zero row
        index = np.full(b * length, weight.shape[0], dtype=np.int64)
        index[feature.mask.reshape(-1)] = feature.inverse
        return padded.index_select(0, torch.from_numpy(index)).view(b, length, weight.shape[1])  # (B, L, D)

    # -- return ------------------------------------------------------------------------------
    def submit_push(
        self, plan: LookupPlan, weights: dict[str, torch.Tensor], *, step: int, scale: float = 1.0
    ) -> list[Pending]:
        """Send each shard the gradients of its rows (multiplied by `scale`, e.g. 1/num_trainers).

        The step doubles as the push's request id: a step re-run after a crash carries the same id,
        and a shard that already applied it drops the retry.
        """
        per_shard: list[TableGradients] = [{} for _ in self.connections]
        for name, source in self._tables_of(plan):
            grad = weights[name].grad
            if grad is None:
                grad = torch.zeros_like(weights[name])
            grad_np = grad.numpy()
            if scale != 1.0:
                grad_np = grad_np * np.float32(scale)
            routed = plan.routed[source]
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
        self, plan: LookupPlan, weights: dict[str, torch.Tensor], *, step: int, scale: float = 1.0
    ) -> None:
        for handle in self.submit_push(plan, weights, step=step, scale=scale):
            handle.result()
