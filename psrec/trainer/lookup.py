"""A batch's embeddings: plan its ids, pull their rows through the PS client, build the model input.

`BatchLookup` is the trainer's view of the parameter server for one batch:

1. **plan** (`plan`): every feature's ids are grouped by table (all features that share a table
   together) and handed to the client's route step, which deduplicates and routes them; the plan
   keeps, per feature, where its ids sit among the table's unique ids;
2. **pull** (`submit_pull` / `collect_pull`): the client fetches the unique rows from the shards;
3. **embed** (`embed`): the unique rows become leaf tensors with `requires_grad`, and the model's
   input is built from them with PyTorch ops (a gather for single-valued features, `embedding_bag`
   sum pooling for bags, indexing for sequences), so autograd produces one gradient row per unique
   id;
4. **push** (`submit_push`): after backward, the leaves' gradients go back through the client.

When all tables have one dim and there are no sequences, the rows of all tables are pulled into ONE
buffer. If every pooled feature then has one id per sample, the plan is *fused*: pooling is one
gather at sample-major positions (`psrec.trainer.pooling`), which the route step writes directly.
Otherwise (bags: multi-valued features) the plan is *bagged*: one kernel pools every feature's bags
from that buffer (`psrec.trainer.bag_pooling`, `LookupPlan.bag_offsets`).

With a `device` (``training.device: cuda``, `psrec.trainer.device`) the rows are copied to it through
pinned memory and the model input is built there with plain PyTorch ops instead of the numba kernels
(which run on CPU buffers): the fused plan's gather is an ``index_select``, the bagged plan's pooling
one ``embedding_bag`` over every feature's bags; the rows' gradients come back to pinned host memory
for the push. The kernels' tests check that this path, run on the CPU, gives the same model input and
row gradients (tests/trainer/test_device_lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from psrec.allocator import ReusableBuffers
from psrec.data.batch import Batch
from psrec.models.base import ModelInput
from psrec.ps.client import (
    LINEAR_SUFFIX,
    EmbeddingClient,
    Pending,
    PulledRows,
    PullRequest,
    RoutedIds,
    ShardConnection,
    fused_key,
    linear_table_name,
)
from psrec.trainer.bag_pooling import pool_bags, transpose_bags
from psrec.trainer.device import to_device, to_host
from psrec.trainer.pooling import gather_rows


@dataclass(frozen=True)
class FeatureIndex:
    name: str
    table: str
    # positions into the table's unique ids; in a fused plan (`LookupPlan.fused_index` set), a view
    # of the fused index, in a bagged one (`LookupPlan.bag_offsets` set) of `bag_index`: positions
    # into the fused buffer
    inverse: np.ndarray
    offsets: np.ndarray | None  # (B,) bag starts for multi-valued pooled features; None otherwise
    mask: np.ndarray | None  # (B, L) for sequences
    single_valued: bool = False  # a pooled feature with exactly one id per sample


@dataclass(frozen=True)
class LookupPlan:
    """One batch's routed ids (`routing`) and per-feature indices into the pulled rows."""

    routing: RoutedIds
    pooled: list[FeatureIndex]
    sequences: list[FeatureIndex]
    batch_size: int
    fused_index: np.ndarray | None = None  # (B * F,) sample-major rows of the fused buffer
    # Bagged plan: every id's row in the fused buffer, and bag (f, b) of pooled feature f is
    # bag_index[bag_offsets[f, b]:bag_offsets[f, b + 1]] (F, B + 1) (`psrec.trainer.bag_pooling`).
    bag_index: np.ndarray | None = None
    bag_offsets: np.ndarray | None = None
    # ... and the backward's layout of those ids, sorted by row (`bag_pooling.transpose_bags`)
    bag_transposed: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def unique_ids(self) -> dict[str, np.ndarray]:
        return self.routing.unique_ids


class RowLeaves:
    """The pulled rows as autograd leaves: one per table, or one per fused buffer (see `LookupPlan`).

    `table(name)` is the tensor the model input is built from; after backward `grad(name)` is that
    table's row gradients (NumPy, a view into its leaf's gradient), None when it got none. With a
    `device`, the leaves are copies on it and the gradients are copied back to host memory, all
    together, at the first `grad` call (`psrec.trainer.device`).
    """

    def __init__(self, pulled: PulledRows, requires_grad: bool, device: torch.device | None = None) -> None:
        self.device = device
        leaf: Callable[[np.ndarray], torch.Tensor] = (
            torch.from_numpy if device is None else lambda rows: to_device(rows, device)
        )
        # "rows" / "linear" -> the fused leaves; table -> its own leaf when not fused
        self.fused = {key: leaf(buffer).requires_grad_(requires_grad) for key, buffer in pulled.fused.items()}
        self.own: dict[str, torch.Tensor] = {}
        self.spans: dict[str, tuple[str, int, int]] = {}  # table -> (fused leaf, first row, end)
        # fused leaf -> (its gradient, that gradient's NumPy view)
        self._fused_grads: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
        for name, rows in pulled.rows.items():
            key = fused_key(name)
            if key in self.fused:
                start, stop = pulled.routing.spans[name.removesuffix(LINEAR_SUFFIX)]
                self.spans[name] = (key, start, stop)
            else:
                self.own[name] = leaf(rows).requires_grad_(requires_grad)
        # with a device: every leaf's gradient in host memory, by (fused or own, name)
        self._host_grads: dict[tuple[bool, str], np.ndarray] | None = None

    def table(self, name: str) -> torch.Tensor:
        if name in self.own:
            return self.own[name]
        key, start, stop = self.spans[name]
        return self.fused[key][start:stop]

    def grad(self, name: str) -> np.ndarray | None:
        """After backward, `name`'s row gradients as a NumPy view; None when it got none. A fused
        leaf's gradient is wrapped once and sliced in NumPy (26 tables' torch slices cost about
        0.3 ms a step)."""
        if self.device is not None:
            return self._host_grad(name)
        if name in self.own:
            grad = self.own[name].grad
            return None if grad is None else grad.numpy()
        key, start, stop = self.spans[name]
        grad = self.fused[key].grad
        if grad is None:
            return None
        cached = self._fused_grads.get(key)
        if cached is None or cached[0] is not grad:
            cached = self._fused_grads[key] = (grad, grad.numpy())
        return cached[1][start:stop]

    def _host_grad(self, name: str) -> np.ndarray | None:
        if self._host_grads is None:  # after backward: every leaf's gradient in one round of copies
            leaves = [((True, k), t) for k, t in self.fused.items()] + [
                ((False, k), t) for k, t in self.own.items()
            ]
            self._host_grads = to_host({key: t.grad for key, t in leaves if t.grad is not None})
        if name in self.own:
            return self._host_grads.get((False, name))
        key, start, stop = self.spans[name]
        grad = self._host_grads.get((True, key))
        return None if grad is None else grad[start:stop]


# (key, table, start of its ids within the batch's / the sequence's ids, count, mask)
_Feature = tuple[str, str, int, int, np.ndarray | None]


class BatchLookup:
    """Plan, pull, embed and push one batch's embeddings (see the module docstring)."""

    def __init__(
        self,
        client: EmbeddingClient,
        *,
        feature_tables: dict[str, str],
        sequence_tables: dict[str, str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.client = client
        self.feature_tables = dict(feature_tables)
        self.sequence_tables = dict(sequence_tables or {})
        # None: CPU tensors over the pulled buffers, numba pooling; else the device path (module docstring)
        self.device = device
        self._gradients = ReusableBuffers()  # the bag pooling's row gradients, reused once pushed

    @property
    def bytes_pulled(self) -> int:
        return self.client.bytes_pulled

    @property
    def bytes_pushed(self) -> int:
        return self.client.bytes_pushed

    # -- plan --------------------------------------------------------------------------------
    def plan(self, batch: Batch) -> LookupPlan:
        """Dedup every table's ids (all features that share a table together) and route them, in one
        numba pass over the batch (the client's `route`)."""
        sparse = batch.sparse
        b = batch.batch_size
        features, sequence_ids = self._features(batch)
        # Group the features' ids by table (a table's features back to back, tables in order of
        # first use); when that is the batch's own layout, its ids array is used as it is.
        per_table: dict[str, list[int]] = {}
        for f, feature in enumerate(features):
            per_table.setdefault(feature[1], []).append(f)
        names = list(per_table)
        order = [f for members in per_table.values() for f in members]
        table_starts = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum([sum(features[f][3] for f in per_table[name]) for name in names], out=table_starts[1:])
        if not batch.sequences and order == list(range(len(features))):
            all_ids = sparse.ids
        else:
            all_ids = np.concatenate(
                [
                    sparse.ids[start : start + size] if mask is None else sequence_ids[key]
                    for key, _, start, size, mask in (features[f] for f in order)
                ]
                or [np.zeros(0, np.int64)]
            )
        # Pooled features with one id per sample, all tables of one dim and no sequences: the rows
        # are pulled into one buffer and pooling is one gather, whose sample-major index the dedup
        # writes directly (block k of `all_ids` is feature order[k], i.e. column order[k]).
        single = [
            sparse.single_valued or (size == b and bool((sparse.lengths[f * b : (f + 1) * b] == 1).all()))
            for f, (_, _, _, size, _) in enumerate(features[: len(sparse.keys)])
        ]
        one_buffer = (
            b > 0
            and bool(single)
            and not batch.sequences
            and len({self.client.table_dims[name] for name in names}) == 1
        )
        fused = one_buffer and all(single)
        routing, inverse, unique_starts = self.client.route(
            all_ids,
            table_starts=table_starts,
            tables=names,
            sample_major=(b, np.asarray(order)) if fused else None,
        )
        if fused:
            grid = inverse.reshape(b, len(features))  # (B, F) positions into the fused buffer
            fused_features = [
                FeatureIndex(key, table, grid[:, f], None, None, True)
                for f, (key, table, _, _, _) in enumerate(features)
            ]
            return LookupPlan(routing, fused_features, [], b, inverse)
        at: dict[int, int] = {}  # feature -> start of its ids in `all_ids` / `inverse`
        for t, name in enumerate(names):
            position = int(table_starts[t])
            for f in per_table[name]:
                at[f] = position
                position += features[f][3]
        if one_buffer:  # bagged: `inverse` numbers all tables' unique ids, as the fused buffer holds them
            return self._bagged_plan(routing, inverse, features, at, b, sparse.lengths)
        position_of = {name: t for t, name in enumerate(names)}
        pooled: list[FeatureIndex] = []
        sequences: list[FeatureIndex] = []
        for f, (key, table, _, size, mask) in enumerate(features):
            index = inverse[at[f] : at[f] + size]  # positions into all tables' unique ids
            local = index - unique_starts[position_of[table]]
            if mask is not None:
                sequences.append(FeatureIndex(key, table, local, None, mask))
                continue
            offsets = None
            if not single[f]:
                lengths = sparse.lengths[f * b : (f + 1) * b]
                offsets = np.zeros(b, dtype=np.int64)
                np.cumsum(lengths[:-1], out=offsets[1:])
            pooled.append(FeatureIndex(key, table, local, offsets, None, single[f]))
        return LookupPlan(routing, pooled, sequences, b, None)

    @staticmethod
    def _bagged_plan(
        routing: RoutedIds,
        inverse: np.ndarray,
        features: list[_Feature],
        at: dict[int, int],
        batch_size: int,
        lengths: np.ndarray,
    ) -> LookupPlan:
        """The plan of pooled features with bags, all tables of one dim and no sequences: the rows are
        pulled into one buffer, and `inverse` (all tables' unique ids numbered back to back, in
        `all_ids` order, feature f's ids from `at[f]`) indexes it directly."""
        b = batch_size
        bag_offsets = np.empty((len(features), b + 1), dtype=np.int64)
        pooled = []
        for f, (key, table, _, size, _) in enumerate(features):
            bag_offsets[f, 0] = at[f]
            np.cumsum(lengths[f * b : (f + 1) * b], out=bag_offsets[f, 1:])
            bag_offsets[f, 1:] += at[f]
            starts = bag_offsets[f, :-1] - at[f]
            pooled.append(FeatureIndex(key, table, inverse[at[f] : at[f] + size], starts, None, False))
        num_rows = sum(ids.size for ids in routing.unique_ids.values())
        transposed = transpose_bags(inverse, bag_offsets, num_rows)  # here, in the planner thread
        return LookupPlan(replace(routing, fused=True), pooled, [], b, None, inverse, bag_offsets, transposed)

    def _features(self, batch: Batch) -> tuple[list[_Feature], dict[str, np.ndarray]]:
        """Every pooled feature and sequence of `batch` with its table, and the sequences' ids."""
        sparse = batch.sparse
        key_starts = sparse.key_starts
        features: list[_Feature] = []
        for k, key in enumerate(sparse.keys):
            start = int(key_starts[k])
            features.append((key, self._feature_table(key), start, int(key_starts[k + 1]) - start, None))
        sequence_ids: dict[str, np.ndarray] = {}
        for key, sequence in batch.sequences.items():
            if key not in self.sequence_tables:
                raise KeyError(
                    f"sequence {key!r} is not mapped to a table; mapped: {sorted(self.sequence_tables)}"
                )
            ids = sequence_ids[key] = sequence.ids[sequence.mask].astype(np.int64, copy=False)
            features.append((key, self.sequence_tables[key], 0, ids.size, sequence.mask))
        return features, sequence_ids

    def _feature_table(self, key: str) -> str:
        try:
            return self.feature_tables[key]
        except KeyError:
            raise KeyError(
                f"feature {key!r} is not mapped to a table; mapped: {sorted(self.feature_tables)}"
            ) from None

    # -- pull ----------------------------------------------------------------------------------
    def submit_pull(self, plan: LookupPlan, *, train: bool = True, request: int | None = None) -> PullRequest:
        return self.client.submit_pull(plan.routing, train=train, request=request)

    def prefetch(self, plan: LookupPlan) -> int:
        return self.client.prefetch(plan.routing)

    def collect_pull(self, plan: LookupPlan, request: PullRequest) -> PulledRows:
        return self.client.collect_pull(plan.routing, request)

    def pull(self, plan: LookupPlan, *, train: bool = True) -> PulledRows:
        return self.client.pull(plan.routing, train=train)

    # -- model input -------------------------------------------------------------------------
    def embed(
        self,
        plan: LookupPlan,
        pulled: PulledRows,
        dense: np.ndarray,
        *,
        requires_grad: bool = True,
        pooled_dtype: torch.dtype = torch.float32,
    ) -> tuple[ModelInput, RowLeaves]:
        """Build the model input from pulled rows; returns it and the rows' leaf tensors (for `push`).

        `pooled_dtype` bfloat16 gathers (pools) the rows of pooled features in bf16 when the rows are
        in one buffer (psrec.trainer.pooling, psrec.trainer.bag_pooling); the rows themselves and their
        gradients stay float32."""
        device = self.device
        leaves = RowLeaves(pulled, requires_grad, device)
        # host arrays (indices, masks, dense features) as tensors where the model input is built
        index: Callable[[np.ndarray], torch.Tensor] = (
            torch.from_numpy if device is None else lambda array: to_device(array, device)
        )
        b = plan.batch_size
        linear_terms = self.client.linear_terms
        linear = None
        if plan.fused_index is not None and device is None:
            # Pooling = one gather over the fused rows (psrec.trainer.pooling). That measured 2x faster
            # than one embedding_bag per feature (26 features, batch 2048, dim 16), and 3x faster
            # than a single fused embedding_bag, whose backward sorts all the indices.
            features = len(plan.pooled)
            pooled = gather_rows(leaves.fused["rows"], plan.fused_index, features, pooled_dtype)
            if linear_terms:
                linear = gather_rows(leaves.fused["linear"], plan.fused_index, features).squeeze(-1)  # (B, F)
        elif plan.fused_index is not None:  # the same gather in PyTorch, on the device
            features = len(plan.pooled)
            fused_index = index(plan.fused_index.astype(np.int64, copy=False))
            # gathered in float32, then cast: the numba gather's bits, and a float32 backward
            pooled = _gather(leaves.fused["rows"], fused_index, features).to(pooled_dtype)
            if linear_terms:
                linear = _gather(leaves.fused["linear"], fused_index, features).squeeze(-1)  # (B, F)
        elif plan.bag_offsets is not None and device is None:
            assert plan.bag_index is not None
            # Every feature's bags pooled by one kernel from the one buffer (psrec.trainer.bag_pooling).
            bags = (plan.bag_index, plan.bag_offsets)
            transposed = plan.bag_transposed
            pooled = pool_bags(
                leaves.fused["rows"],
                *bags,
                dtype=pooled_dtype,
                transposed=transposed,
                buffers=self._gradients,
            )
            if linear_terms:
                linear = pool_bags(leaves.fused["linear"], *bags, transposed=transposed).squeeze(-1)
        elif plan.bag_offsets is not None:  # every feature's bags by one embedding_bag, on the device
            assert plan.bag_index is not None
            flat_index, flat_offsets = _flat_bags(plan.bag_index, plan.bag_offsets)
            flat = (index(flat_index), index(flat_offsets), plan.bag_offsets.shape[0])
            pooled = _pool_flat(leaves.fused["rows"], *flat).to(pooled_dtype)  # float32 sums, cast once
            if linear_terms:
                linear = _pool_flat(leaves.fused["linear"], *flat).squeeze(-1)  # (B, F)
        elif plan.pooled:
            pooled = _pool(leaves, plan.pooled, b, lambda table: table, index)  # (B, F, D)
            if linear_terms:
                linear = _pool(leaves, plan.pooled, b, linear_table_name, index).squeeze(-1)  # (B, F)
        else:  # sequence-only models (SASRec)
            dim = next(iter(self.client.table_dims.values()), 1)
            pooled = torch.zeros(b, 0, dim, device=device)
        sequences, masks, ids = {}, {}, {}
        for f in plan.sequences:
            assert f.mask is not None
            sequences[f.name] = _sequence(leaves.table(f.table), f, index)
            masks[f.name] = index(f.mask)
            ids[f.name] = index(_sequence_ids(f))
        dense_input = (
            torch.from_numpy(np.require(dense, requirements="W")) if device is None else index(dense)
        )
        return ModelInput(dense_input, pooled, linear, sequences, masks, ids=ids), leaves

    # -- push ----------------------------------------------------------------------------------
    def submit_push(
        self, plan: LookupPlan, leaves: RowLeaves, *, step: int, scale: float = 1.0
    ) -> list[Pending]:
        """Push the leaves' row gradients (times `scale`); see `EmbeddingClient.submit_push`."""
        return self.client.submit_push(plan.routing, leaves.grad, step=step, scale=scale)

    def submit_empty_push(self, *, step: int) -> list[Pending]:
        return self.client.submit_empty_push(step=step)

    def push(self, plan: LookupPlan, leaves: RowLeaves, *, step: int, scale: float = 1.0) -> None:
        for handle in self.submit_push(plan, leaves, step=step, scale=scale):
            handle.result()


def _pool(
    leaves: RowLeaves,
    features: list[FeatureIndex],
    batch_size: int,
    table_of: Callable[[str], str],
    index: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
) -> torch.Tensor:
    """Sum-pool every feature from per-table rows: (B, F, D); a gather for single-valued features,
    embedding_bag for the others. `index` turns the host indices into tensors beside the rows."""
    pooled = []
    for f in features:
        weight = leaves.table(table_of(f.table))
        inverse = index(f.inverse)
        if f.single_valued:
            pooled.append(weight.index_select(0, inverse))
        else:
            assert f.offsets is not None
            pooled.append(F.embedding_bag(inverse, weight, index(f.offsets), mode="sum"))
    return torch.stack(pooled, dim=1)


def _sequence(
    weight: torch.Tensor,
    feature: FeatureIndex,
    to_tensor: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
) -> torch.Tensor:
    assert feature.mask is not None
    b, length = feature.mask.shape
    padded = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])  # padding -> zero row
    index = np.full(b * length, weight.shape[0], dtype=np.int64)
    index[feature.mask.reshape(-1)] = feature.inverse
    return padded.index_select(0, to_tensor(index)).view(b, length, weight.shape[1])  # (B, L, D)


def _sequence_ids(feature: FeatureIndex) -> np.ndarray:
    """(B, L) int64: each item's row among the batch's pulled rows (`ModelInput.ids`), -1 at padding."""
    assert feature.mask is not None
    ids = np.full(feature.mask.shape, -1, dtype=np.int64)
    ids[feature.mask] = feature.inverse
    return ids


def _gather(rows: torch.Tensor, index: torch.Tensor, features: int) -> torch.Tensor:
    """(B, features, D) = rows[index] for sample-major `index` (`psrec.trainer.pooling.gather_rows`'s
    values, by PyTorch's ``index_select``)."""
    return rows.index_select(0, index).view(-1, features, rows.shape[1])


def _flat_bags(index: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bagged plan's bags (`LookupPlan.bag_index`, `bag_offsets` (F, B + 1)) as one ``embedding_bag``
    input: (ids, bag starts (F * B,)), bag f * B + b being bag (f, b). Each feature's ids are one run
    of `index`; the runs are put back to back in feature order."""
    starts, ends = offsets[:, 0], offsets[:, -1]
    flat = np.concatenate([index[start:end] for start, end in zip(starts, ends, strict=True)])
    run_starts = np.zeros(len(starts), dtype=np.int64)
    np.cumsum((ends - starts)[:-1], out=run_starts[1:])
    bag_starts = offsets[:, :-1] - starts[:, None] + run_starts[:, None]  # (F, B)
    return flat.astype(np.int64, copy=False), bag_starts.reshape(-1).astype(np.int64, copy=False)


def _pool_flat(
    rows: torch.Tensor, index: torch.Tensor, bag_starts: torch.Tensor, features: int
) -> torch.Tensor:
    """(B, F, D) sums of the bags `_flat_bags` laid out (`psrec.trainer.bag_pooling.pool_bags`'s values)."""
    pooled = F.embedding_bag(index, rows, bag_starts, mode="sum")  # (F * B, D); an empty bag is zeros
    return pooled.view(features, -1, rows.shape[1]).transpose(0, 1).contiguous()


def batch_lookup(
    connections: list[ShardConnection],
    bucket_to_shard: np.ndarray,
    *,
    table_dims: dict[str, int],
    feature_tables: dict[str, str],
    sequence_tables: dict[str, str] | None = None,
    linear_terms: bool = False,
    trainer_index: int = 0,
    wire_precision: str = "fp32",
    device: torch.device | None = None,
) -> BatchLookup:
    """A `BatchLookup` over a new `EmbeddingClient` of `connections` (see both for the arguments)."""
    client = EmbeddingClient(
        connections,
        bucket_to_shard,
        table_dims=table_dims,
        linear_terms=linear_terms,
        trainer_index=trainer_index,
        wire_precision=wire_precision,
    )
    return BatchLookup(client, feature_tables=feature_tables, sequence_tables=sequence_tables, device=device)
