"""A batch with bags through the lookup plan (one buffer, one pooling kernel) against nn.EmbeddingBag.

Oracle: per feature, ``nn.EmbeddingBag(mode="sum")`` over the rows the tables hold for the batch's
ids (pulled untouched from a twin table), its gradients, and the SGD update they give.
"""

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from psrec.data.batch import Batch, SparseBatch
from psrec.embedding import EmbeddingTable, InitializerSpec, SparseOptimizerSpec
from psrec.ps.client import LocalConnection
from psrec.ps.routing import default_bucket_map
from psrec.ps.shard import ParameterShard
from psrec.trainer.lookup import batch_lookup

DIM = 16
LR = 0.5
FEATURE_TABLES = {"user": "users", "tags": "tags", "history": "items", "item": "items"}


def make_table(name: str, dim: int = DIM) -> EmbeddingTable:
    return EmbeddingTable(
        name,
        dim,
        optimizer=SparseOptimizerSpec("sgd", lr=LR),
        initializer=InitializerSpec("uniform", scale=0.1),
    )


def _tables(linear: bool) -> dict[str, EmbeddingTable]:
    tables = {name: make_table(name) for name in ("users", "tags", "items")}
    if linear:
        tables.update(
            {f"{name}__linear": make_table(f"{name}__linear", 1) for name in ("users", "tags", "items")}
        )
    return tables


def _batch(rng: np.random.Generator, batch_size: int) -> Batch:
    """user: one id; tags: 0-6 ids (empty bags); history: 3-20 ids sharing table items with item."""
    features = {
        "user": (rng.integers(0, 50, batch_size), np.ones(batch_size, np.int32)),
    }
    for key, low, high, ids in (("tags", 0, 6, 30), ("history", 3, 20, 80)):
        lengths = rng.integers(low, high + 1, batch_size).astype(np.int32)
        features[key] = (rng.integers(0, ids, int(lengths.sum())), lengths)
    features["item"] = (rng.integers(0, 80, batch_size), np.ones(batch_size, np.int32))
    return Batch(
        labels=np.zeros(batch_size, np.float32),
        dense=np.zeros((batch_size, 0), np.float32),
        sparse=SparseBatch.from_features(features),
    )


class _CopyingConnection:
    """A shard behind the plain connection interface (replies copied, as a remote shard's are)."""

    def __init__(self, shard: ParameterShard) -> None:
        self.inner = LocalConnection(shard)

    def pull(self, requests: dict[str, np.ndarray], *, train: bool, request: int | None = None) -> Any:
        return self.inner.pull(requests, train=train, request=request)

    def push(self, trainer: int, request_id: int, step: int, gradients: Any) -> Any:
        return self.inner.push(trainer, request_id, step, gradients)


@pytest.mark.parametrize(
    ("num_shards", "copying", "linear"), [(1, False, False), (2, False, True), (2, True, False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bags_pool_push_and_update_like_embedding_bag(
    num_shards: int, copying: bool, linear: bool, dtype: torch.dtype
) -> None:
    rng = np.random.default_rng(num_shards)
    shards = [ParameterShard(s, _tables(linear)) for s in range(num_shards)]
    connections: list[Any] = [_CopyingConnection(s) if copying else LocalConnection(s) for s in shards]
    client = batch_lookup(
        connections,
        default_bucket_map(16, num_shards),
        table_dims={"users": DIM, "tags": DIM, "items": DIM},
        feature_tables=FEATURE_TABLES,
        linear_terms=linear,
    )
    batch = _batch(rng, 37)
    plan = client.plan(batch)
    assert plan.bag_offsets is not None and plan.fused_index is None and plan.routing.fused
    inp, leaves = client.embed(plan, client.pull(plan), batch.dense, pooled_dtype=dtype)
    assert inp.pooled.shape == (37, 4, DIM) and inp.pooled.dtype == dtype

    # Oracle: one EmbeddingBag per feature over twin tables' rows of the ids it sees.
    twins = _tables(linear)
    bags, expected, expected_linear = {}, [], []
    for key, table in FEATURE_TABLES.items():
        ids, lengths = batch.sparse.feature(key)
        distinct, local = np.unique(ids, return_inverse=True)
        starts = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
        bag = nn.EmbeddingBag.from_pretrained(
            torch.from_numpy(twins[table].pull(distinct)), freeze=False, mode="sum"
        )
        bags[key] = (bag, distinct)
        expected.append(bag(torch.from_numpy(local), starts))
        if linear:
            rows = torch.from_numpy(twins[f"{table}__linear"].pull(distinct))
            expected_linear.append(
                nn.functional.embedding_bag(torch.from_numpy(local), rows, starts, mode="sum")
            )
    pooled = torch.stack(expected, dim=1)
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6  # bf16: one ulp (another float32 summation order)
    torch.testing.assert_close(inp.pooled.float(), pooled.to(dtype).float(), rtol=rtol, atol=1e-6)
    if linear:
        assert inp.linear is not None
        torch.testing.assert_close(inp.linear, torch.stack(expected_linear, dim=1).squeeze(-1))

    upstream = torch.from_numpy(rng.normal(size=(37, 4, DIM)).astype(np.float32))
    (inp.pooled.float() * upstream).sum().backward()
    (pooled * upstream.to(dtype).float()).sum().backward()
    client.push(plan, leaves, step=0)
    # After SGD every touched row moved by -lr * (its gradient summed over the features of its table).
    for table in ("users", "tags", "items"):
        ids = plan.unique_ids[table]
        grad = np.zeros((ids.size, DIM), np.float32)
        position = {int(i): k for k, i in enumerate(ids)}
        for key, (bag, distinct) in bags.items():
            if FEATURE_TABLES[key] == table:
                assert bag.weight.grad is not None
                grad[[position[int(i)] for i in distinct]] += bag.weight.grad.numpy()
        got = leaves.grad(table)
        assert got is not None
        np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-5)
        after = client.pull(client.plan(batch), train=False).rows[table]
        ids_after = client.plan(batch).unique_ids[table]
        np.testing.assert_array_equal(np.sort(ids_after), np.sort(ids))
        before = twins[table].pull(ids_after)
        order = [position[int(i)] for i in ids_after]
        np.testing.assert_allclose(after, before - LR * grad[order], rtol=1e-5, atol=1e-6)


def test_single_valued_batches_keep_the_sample_major_gather() -> None:
    shard = ParameterShard(0, _tables(False))
    client = batch_lookup(
        [LocalConnection(shard)],
        default_bucket_map(4, 1),
        table_dims={"users": DIM, "items": DIM},
        feature_tables={"user": "users", "item": "items"},
    )
    ones = np.ones(5, np.int32)
    sparse = SparseBatch.from_features({"user": (np.arange(5), ones), "item": (np.arange(5) + 3, ones)})
    plan = client.plan(Batch(np.zeros(5, np.float32), np.zeros((5, 0), np.float32), sparse))
    assert plan.fused_index is not None and plan.bag_offsets is None
