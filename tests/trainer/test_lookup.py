"""A batch's embeddings through the PS client (plan, pull, model input, push) against plain PyTorch."""

from typing import Any

import numpy as np
import pytest
import torch

from psrec.data.batch import Batch, PaddedSequence, SparseBatch
from psrec.embedding import EmbeddingTable, InitializerSpec, SparseOptimizerSpec
from psrec.ps.client import LocalConnection
from psrec.ps.routing import default_bucket_map
from psrec.ps.shard import ParameterShard
from psrec.trainer.lookup import BatchLookup, batch_lookup

DIM = 4


def make_table(name: str = "t", lr: float = 0.5) -> EmbeddingTable:
    return EmbeddingTable(
        name,
        DIM,
        optimizer=SparseOptimizerSpec("sgd", lr=lr),
        initializer=InitializerSpec("uniform", scale=0.1),
    )


def make_shards(num_shards: int, *, num_trainers: int = 1, mode: str = "sync") -> list[ParameterShard]:
    return [
        ParameterShard(i, {"t": make_table()}, num_trainers=num_trainers, mode=mode)
        for i in range(num_shards)
    ]


def _batch() -> Batch:
    sparse = SparseBatch.from_features(
        {
            "a": (np.array([10, 11, 10]), np.array([1, 1, 1])),
            "b": (np.array([11, 12, 13, 2**62, -5]), np.array([2, 0, 3])),
        }
    )
    history = PaddedSequence(
        ids=np.array([[0, 10, 12], [0, 0, 11], [13, 12, 11]]),
        mask=np.array([[False, True, True], [False, False, True], [True, True, True]]),
    )
    return Batch(
        labels=np.array([1.0, 0.0, 1.0], dtype=np.float32),
        dense=np.zeros((3, 0), dtype=np.float32),
        sparse=sparse,
        sequences={"history": history},
    )


@pytest.mark.parametrize("num_shards", [1, 3])
def test_client_matches_plain_pytorch_embedding(num_shards: int) -> None:
    """Pooling, sequences and the SGD update through shards equal a dense nn.Embedding reference."""
    shards = make_shards(num_shards)
    client = batch_lookup(
        [LocalConnection(s) for s in shards],
        default_bucket_map(16, num_shards),
        table_dims={"t": DIM},
        feature_tables={"a": "t", "b": "t"},
        sequence_tables={"history": "t"},
    )
    batch = _batch()
    plan = client.plan(batch)
    pulled = client.pull(plan)
    inp, weights = client.embed(plan, pulled, batch.dense)

    # Reference: a dense table of the same rows (deterministic init: any table gives the same rows).
    all_ids = np.unique(np.concatenate([batch.sparse.ids, batch.sequences["history"].ids.reshape(-1)]))
    reference_rows = make_table().pull(all_ids)
    weight = torch.nn.Parameter(torch.from_numpy(reference_rows.copy()))
    position = {int(i): k for k, i in enumerate(all_ids)}

    def rows(ids: np.ndarray) -> torch.Tensor:
        return weight[torch.tensor([position[int(i)] for i in ids], dtype=torch.long)]

    pooled_a = torch.stack([rows(np.array([i])).sum(0) for i in [10, 11, 10]])
    b_ids, b_lengths = batch.sparse.feature("b")
    starts = np.concatenate([[0], np.cumsum(b_lengths)[:-1]])
    pooled_b = torch.stack(
        [
            rows(b_ids[s : s + n]).sum(0) if n else torch.zeros(DIM)
            for s, n in zip(starts, b_lengths, strict=True)
        ]
    )
    history = batch.sequences["history"]
    seq = torch.stack(
        [
            torch.stack(
                [rows(np.array([i]))[0] if m else torch.zeros(DIM) for i, m in zip(r, mr, strict=True)]
            )
            for r, mr in zip(history.ids, history.mask, strict=True)
        ]
    )
    torch.testing.assert_close(inp.pooled, torch.stack([pooled_a, pooled_b], dim=1))
    torch.testing.assert_close(inp.sequences["history"], seq)
    # ModelInput.ids: -1 at padding; equal numbers exactly where the item ids are equal, each the
    # item's row among the pulled rows
    ids, real = inp.ids["history"], torch.from_numpy(history.mask)
    assert ids.dtype == torch.int64 and (ids[~real] == -1).all()
    items = torch.from_numpy(history.ids)[real]
    assert torch.equal(ids[real][:, None] == ids[real][None, :], items[:, None] == items[None, :])
    torch.testing.assert_close(weights.table("t")[ids[real]], seq[real])

    target = torch.arange(inp.pooled.numel(), dtype=torch.float32).view_as(inp.pooled) / 10
    loss = (inp.pooled * target).sum() + (inp.sequences["history"] ** 2).sum()
    loss.backward()
    client.push(plan, weights, step=0)
    reference_loss = (torch.stack([pooled_a, pooled_b], dim=1) * target).sum() + (seq**2).sum()
    reference_loss.backward()
    with torch.no_grad():
        expected = weight - 0.5 * weight.grad
    after = client.pull(client.plan(batch), train=False).rows["t"]
    pulled_ids = plan.unique_ids["t"]
    np.testing.assert_allclose(
        after, expected.numpy()[[position[int(i)] for i in pulled_ids]], rtol=1e-5, atol=1e-6
    )
    assert sum(s.tables["t"].num_rows for s in shards) == all_ids.size - 1  # the padding id 0 is never pulled


def test_single_valued_features_pool_by_gather_like_embedding_bag() -> None:
    """The all-single-valued fast path (one gather over concatenated tables) equals embedding_bag."""
    tables = {"t": make_table("t"), "u": make_table("u")}
    shard = ParameterShard(0, tables)
    client = batch_lookup(
        [LocalConnection(shard)],
        default_bucket_map(4, 1),
        table_dims={"t": DIM, "u": DIM},
        feature_tables={"a": "t", "b": "u", "c": "t"},
    )
    sparse = SparseBatch.from_features(
        {
            "a": (np.array([1, 2, 1]), np.array([1, 1, 1])),
            "b": (np.array([7, 7, 9]), np.array([1, 1, 1])),
            "c": (np.array([2, 3, 4]), np.array([1, 1, 1])),
        }
    )
    batch = Batch(np.zeros(3, np.float32), np.zeros((3, 0), np.float32), sparse)
    plan = client.plan(batch)
    assert all(f.single_valued for f in plan.pooled)
    assert plan.fused_index is not None
    all_unique = np.concatenate(list(plan.unique_ids.values()))  # the fused buffer's ids, table by table
    for f, key in enumerate(("a", "b", "c")):
        np.testing.assert_array_equal(
            all_unique[plan.fused_index.reshape(3, 3)[:, f]], sparse.feature(key)[0]
        )
        np.testing.assert_array_equal(all_unique[plan.pooled[f].inverse], sparse.feature(key)[0])
    pulled = client.pull(plan)
    inp, weights = client.embed(plan, pulled, batch.dense)
    expected = []
    for key in ("a", "b", "c"):
        table = client.feature_tables[key]
        ids, lengths = sparse.feature(key)
        rows = torch.from_numpy(tables[table].pull(ids, train=False))
        expected.append(torch.nn.functional.embedding_bag(torch.arange(3), rows, torch.arange(3), mode="sum"))
    torch.testing.assert_close(inp.pooled, torch.stack(expected, dim=1))
    (inp.pooled * torch.arange(1.0, 4.0).view(1, 3, 1)).sum().backward(retain_graph=True)
    # Feature a (table t, weight 1) and c (table t, weight 3): id 2 appears once in each -> grad 4.
    unique_t = plan.unique_ids["t"].tolist()
    np.testing.assert_allclose(weights.grad("t")[unique_t.index(2)], np.full(DIM, 4.0))
    unique_u = plan.unique_ids["u"].tolist()
    np.testing.assert_allclose(weights.grad("u")[unique_u.index(7)], np.full(DIM, 4.0))  # twice x 2
    fused = weights.fused["rows"]
    for table in ("t", "u"):  # views of the fused leaf's gradient, and fresh after a new backward
        start, stop = plan.routing.spans[table]
        assert fused.grad is not None
        np.testing.assert_array_equal(weights.grad(table), fused.grad[start:stop].numpy())
    fused.grad = None
    assert weights.grad("t") is None
    (inp.pooled * 2).sum().backward()  # a new gradient tensor: not the one seen before
    start, stop = plan.routing.spans["t"]
    np.testing.assert_array_equal(weights.grad("t"), fused.grad[start:stop].numpy())
    np.testing.assert_allclose(weights.grad("t")[unique_t.index(2)], np.full(DIM, 4.0))  # 2 + 2


class _CopyingConnection:
    """A local shard behind the plain connection interface (no `out`): replies are copied, as a
    remote shard's are."""

    def __init__(self, shard: ParameterShard) -> None:
        self.inner = LocalConnection(shard)

    def pull(self, requests: dict[str, np.ndarray], *, train: bool, request: int | None = None) -> Any:
        return self.inner.pull(requests, train=train, request=request)

    def push(self, trainer: int, request_id: int, step: int, gradients: Any) -> Any:
        return self.inner.push(trainer, request_id, step, gradients)


@pytest.mark.parametrize("linear_terms", [False, True])
def test_in_process_shards_pull_into_the_fused_buffer_like_copied_replies(linear_terms: bool) -> None:
    """Two in-process shards write their rows straight into the fused buffer's slices; the result
    (and every later step) equals that of shards whose replies are copied in."""

    def client_of(connection: Any) -> tuple[BatchLookup, list[ParameterShard]]:
        shards = []
        for index in range(2):
            tables = {"t": make_table("t"), "u": make_table("u")}
            if linear_terms:
                for name in ("t__linear", "u__linear"):
                    tables[name] = EmbeddingTable(name, 1, optimizer=SparseOptimizerSpec("sgd", lr=0.5))
            shards.append(ParameterShard(index, tables))
        client = batch_lookup(
            [connection(shard) for shard in shards],
            default_bucket_map(8, 2),
            table_dims={"t": DIM, "u": DIM},
            feature_tables={"a": "t", "b": "u", "c": "t"},
            linear_terms=linear_terms,
        )
        return client, shards

    rng = np.random.default_rng(0)
    (direct, direct_shards), (copied, _) = client_of(LocalConnection), client_of(_CopyingConnection)
    for step in range(3):
        ids = {key: rng.integers(0, 40, 16) for key in ("a", "b", "c")}
        sparse = SparseBatch.from_features(
            {key: (value, np.ones(16, np.int64)) for key, value in ids.items()}
        )
        batch = Batch(np.zeros(16, np.float32), np.zeros((16, 0), np.float32), sparse)
        results = []
        for client in (direct, copied):
            plan = client.plan(batch)
            assert plan.fused_index is not None
            request = client.submit_pull(plan)
            pulled_tables = [*plan.unique_ids, *(f"{n}__linear" for n in plan.unique_ids if linear_terms)]
            expected_in_place = {
                (shard, name)
                for shard in range(2)
                for name in pulled_tables
                if plan.routing.routed[name.removesuffix("__linear")].ids_per_shard[shard].size
            }
            assert request.in_place == (expected_in_place if client is direct else set())
            pulled = client.collect_pull(plan, request)
            for name, rows in pulled.rows.items():
                assert np.shares_memory(rows, pulled.fused["linear" if name.endswith("__linear") else "rows"])
            inp, leaves = client.embed(plan, pulled, batch.dense)
            loss = (inp.pooled * torch.arange(1.0, 4.0).view(1, 3, 1)).sum()
            if linear_terms:
                assert inp.linear is not None
                loss = loss + inp.linear.sum()
            loss.backward()
            client.push(plan, leaves, step=step)
            results.append({name: rows.copy() for name, rows in pulled.rows.items()})
        assert results[0].keys() == results[1].keys()
        for name in results[0]:
            np.testing.assert_array_equal(results[0][name], results[1][name])
    assert direct_shards[0].tables["t"].num_rows > 0 and direct_shards[1].tables["t"].num_rows > 0


def test_table_pull_into_an_array() -> None:
    table = make_table()
    table.pull(np.array([1, 2]))
    out = np.full((3, DIM), -7.0, np.float32)
    assert table.pull(np.array([2, 1, 5]), train=False, out=out) is out  # 5: absent, initial values
    np.testing.assert_array_equal(out, table.pull(np.array([2, 1, 5]), train=False))
    assert table.num_rows == 2
    with pytest.raises(ValueError, match=r"C-contiguous float32 array of shape \(2, 4\)"):
        table.pull(np.array([1, 2]), out=np.zeros((2, DIM), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        table.pull(np.array([1, 2]), out=np.zeros((DIM, 2), np.float32).T)
