"""The lookup's device path (plain PyTorch ops, what a GPU trainer runs) against the numba CPU path.

The device path runs with device "cpu" by default, and on "cuda" in the `gpu` tier (``-m gpu``,
skipped without a CUDA device): for every kind of plan (fused gather, bagged pooling, per-table with
sequences) it must give the model input and the row gradients of the numba kernels
(`psrec.trainer.pooling`, `psrec.trainer.bag_pooling`), which their own tests check against
``nn.EmbeddingBag``; the bagged case is also checked against ``nn.EmbeddingBag`` directly. A few
steps of a `StepRunner` over each path train the same model; on a GPU, within float tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from psrec.data.batch import Batch, PaddedSequence, SparseBatch
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.embedding import EmbeddingTable, InitializerSpec, SparseOptimizerSpec
from psrec.models.base import ModelInput
from psrec.ps.client import LocalConnection
from psrec.ps.routing import default_bucket_map
from psrec.ps.shard import ParameterShard
from psrec.trainer import builders
from psrec.trainer.device import host_copy, pinned, to_device, to_host
from psrec.trainer.lookup import BatchLookup, _flat_bags, batch_lookup
from psrec.trainer.step import StepRunner
from tests.conftest import small_run_config

DIM = 8
CPU = torch.device("cpu")
TABLES = ("users", "tags", "items")
NO_CUDA = not torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=GPU)]


def _tables(linear: bool) -> dict[str, EmbeddingTable]:
    names = [*TABLES, *(f"{name}__linear" for name in TABLES if linear)]
    return {
        name: EmbeddingTable(
            name,
            1 if name.endswith("__linear") else DIM,
            optimizer=SparseOptimizerSpec("sgd", lr=0.5),
            initializer=InitializerSpec("uniform", scale=0.1),
        )
        for name in names
    }


def _lookups(
    feature_tables: dict[str, str],
    *,
    device: str = "cpu",
    linear: bool = False,
    sequence_tables: dict[str, str] | None = None,
) -> tuple[BatchLookup, BatchLookup]:
    """(numba path, device path on `device`), each over its own 2 shards holding the same rows."""

    def lookup(device: torch.device | None) -> BatchLookup:
        shards = [ParameterShard(s, _tables(linear)) for s in range(2)]
        return batch_lookup(
            [LocalConnection(s) for s in shards],
            default_bucket_map(16, 2),
            table_dims=dict.fromkeys(TABLES, DIM),
            feature_tables=feature_tables,
            sequence_tables=sequence_tables,
            linear_terms=linear,
            device=device,
        )

    return lookup(None), lookup(torch.device(device))


def _single_valued(rng: np.random.Generator, size: int) -> Batch:
    ones = np.ones(size, np.int32)
    features = {key: (rng.integers(0, 40, size), ones) for key in ("user", "item", "tag")}
    return Batch(
        np.zeros(size, np.float32), np.zeros((size, 0), np.float32), SparseBatch.from_features(features)
    )


def _bags(rng: np.random.Generator, size: int) -> Batch:
    """Bags of 0-6 and 3-12 ids (empty bags too); the features' order is not their tables' order, so
    the bagged plan's per-feature runs of ids are not in feature order."""
    features: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, low, high in (("history", 3, 12), ("tags", 0, 6)):
        lengths = rng.integers(low, high + 1, size).astype(np.int32)
        features[key] = (rng.integers(0, 60, int(lengths.sum())), lengths)
    features["item"] = (rng.integers(0, 60, size), np.ones(size, np.int32))
    features["user"] = (rng.integers(0, 30, size), np.ones(size, np.int32))
    return Batch(
        np.zeros(size, np.float32), np.zeros((size, 0), np.float32), SparseBatch.from_features(features)
    )


BAG_TABLES = {"history": "items", "tags": "tags", "item": "items", "user": "users"}


def _embed_and_backward(
    lookup: BatchLookup, batch: Batch, upstream: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[Any, dict[str, np.ndarray | None]]:
    plan = lookup.plan(batch)
    inp, leaves = lookup.embed(plan, lookup.pull(plan), batch.dense, pooled_dtype=dtype)
    upstream = {name: grad.to(inp.pooled.device) for name, grad in upstream.items()}
    loss = (inp.pooled.float() * upstream["pooled"]).sum()
    if inp.linear is not None:
        loss = loss + (inp.linear * upstream["linear"]).sum()
    for name, sequence in inp.sequences.items():
        loss = loss + (sequence * upstream[name]).sum()
    loss.backward()
    names = list(plan.unique_ids) + [f"{t}__linear" for t in plan.unique_ids if inp.linear is not None]
    return inp, {name: leaves.grad(name) for name in names}


def _compare(
    numba: BatchLookup, device: BatchLookup, batch: Batch, dtype: torch.dtype, *, exact_pooling: bool
) -> Any:
    rng = np.random.default_rng(7)
    features = len(batch.sparse.keys)
    upstream = {
        "pooled": torch.from_numpy(rng.normal(size=(batch.batch_size, features, DIM)).astype(np.float32)),
        "linear": torch.from_numpy(rng.normal(size=(batch.batch_size, features)).astype(np.float32)),
    }
    for name, sequence in batch.sequences.items():
        shape = (*sequence.ids.shape, DIM)
        upstream[name] = torch.from_numpy(rng.normal(size=shape).astype(np.float32))
    expected, expected_grads = _embed_and_backward(numba, batch, upstream, dtype)
    on_device, grads = _embed_and_backward(device, batch, upstream, dtype)
    assert device.device is not None and on_device.pooled.device.type == device.device.type
    got = _on_cpu(on_device)
    assert got.pooled.shape == expected.pooled.shape and got.pooled.dtype == expected.pooled.dtype == dtype
    assert got.pooled.is_contiguous()
    if exact_pooling and device.device == CPU:  # a gather moves values: the same bits
        assert torch.equal(got.pooled, expected.pooled)
    else:  # float32 sums in another order; bf16: the sums rounded once, one ulp apart at most
        rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got.pooled.float(), expected.pooled.float(), rtol=rtol, atol=1e-6)
    assert (got.linear is None) == (expected.linear is None)
    if got.linear is not None:
        torch.testing.assert_close(got.linear, expected.linear, rtol=1e-5, atol=1e-6)
    for name, sequence in expected.sequences.items():
        assert torch.equal(got.sequences[name], sequence)
        assert torch.equal(got.masks[name], expected.masks[name])
    torch.testing.assert_close(got.dense, expected.dense)
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        assert grad is not None and grads[name] is not None, name
        np.testing.assert_allclose(grads[name], grad, rtol=1e-5, atol=1e-6, err_msg=name)
    return got


def _on_cpu(inp: ModelInput) -> ModelInput:
    def cpu(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().cpu()

    return ModelInput(
        cpu(inp.dense),
        cpu(inp.pooled),
        None if inp.linear is None else cpu(inp.linear),
        {name: cpu(t) for name, t in inp.sequences.items()},
        {name: cpu(t) for name, t in inp.masks.items()},
    )


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gather_matches_the_numba_gather(device_name: str, linear: bool, dtype: torch.dtype) -> None:
    tables = {"user": "users", "item": "items", "tag": "items"}
    numba, device = _lookups(tables, device=device_name, linear=linear)
    batch = _single_valued(np.random.default_rng(1), 33)
    assert numba.plan(batch).fused_index is not None
    _compare(numba, device, batch, dtype, exact_pooling=True)


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bags_match_the_numba_pooling_and_embedding_bag(
    device_name: str, linear: bool, dtype: torch.dtype
) -> None:
    numba, device = _lookups(BAG_TABLES, device=device_name, linear=linear)
    batch = _bags(np.random.default_rng(2), 29)
    plan = device.plan(batch)
    assert plan.bag_offsets is not None and plan.fused_index is None
    got = _compare(numba, device, batch, dtype, exact_pooling=False)

    # Oracle: per feature, nn.EmbeddingBag over the rows of the ids it sees.
    twins = _tables(linear)
    expected = []
    for key, table in BAG_TABLES.items():
        ids, lengths = batch.sparse.feature(key)
        distinct, local = np.unique(ids, return_inverse=True)
        starts = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
        bag = nn.EmbeddingBag.from_pretrained(torch.from_numpy(twins[table].pull(distinct)), mode="sum")
        expected.append(bag(torch.from_numpy(local), starts))
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    oracle = torch.stack(expected, dim=1).to(dtype).float()
    torch.testing.assert_close(got.pooled.float(), oracle, rtol=rtol, atol=1e-6)


def test_flat_bags_put_each_features_run_in_feature_order() -> None:
    # feature 0's ids are index[4:7] (bags [4, 5), [5, 7)), feature 1's index[0:4] (bags [0, 0), [0, 4))
    index = np.array([10, 11, 12, 13, 20, 21, 22])
    offsets = np.array([[4, 5, 7], [0, 0, 4]])
    flat, starts = _flat_bags(index, offsets)
    np.testing.assert_array_equal(flat, [20, 21, 22, 10, 11, 12, 13])
    np.testing.assert_array_equal(starts, [0, 1, 3, 3])  # bags (f, b) at f * B + b


@pytest.mark.parametrize("device_name", DEVICES)
def test_sequences_and_per_table_pooling_match(device_name: str) -> None:
    tables = {"a": "items", "b": "items"}
    numba, device = _lookups(tables, device=device_name, sequence_tables={"history": "items"})
    sparse = SparseBatch.from_features(
        {
            "a": (np.array([10, 11, 10]), np.array([1, 1, 1])),
            "b": (np.array([11, 12, 13, 2, 5]), np.array([2, 0, 3])),
        }
    )
    history = PaddedSequence(
        ids=np.array([[0, 10, 12], [0, 0, 11], [13, 12, 11]]),
        mask=np.array([[False, True, True], [False, False, True], [True, True, True]]),
    )
    batch = Batch(
        labels=np.array([1.0, 0.0, 1.0], np.float32),
        dense=np.ones((3, 2), np.float32),
        sparse=sparse,
        sequences={"history": history},
    )
    plan = device.plan(batch)
    assert plan.fused_index is None and plan.bag_offsets is None and plan.sequences
    _compare(numba, device, batch, torch.float32, exact_pooling=False)


def test_host_transfers_on_the_cpu_share_memory() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = to_device(array, CPU)
    assert tensor.data_ptr() == array.ctypes.data  # the CPU path copies nothing
    back = to_host({"rows": tensor})["rows"]
    assert back.ctypes.data == array.ctypes.data
    state = {"w": torch.ones(2, requires_grad=True), "nested": [torch.zeros(1)], "step": 3}
    copied = host_copy(state)
    assert copied["step"] == 3 and not copied["w"].requires_grad
    assert copied["w"].data_ptr() != state["w"].data_ptr() and torch.equal(copied["w"], state["w"].detach())


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_rows_go_through_pinned_memory_both_ways() -> None:
    cuda = torch.device("cuda")
    rows = np.random.default_rng(0).normal(size=(5, DIM)).astype(np.float32)
    assert pinned(rows).is_pinned()
    on_device = to_device(rows, cuda)
    assert on_device.device.type == "cuda"
    np.testing.assert_array_equal(on_device.cpu().numpy(), rows)
    back = to_host({"rows": on_device * 2})["rows"]
    assert torch.from_numpy(back).is_pinned()
    np.testing.assert_array_equal(back, rows * 2)
    # the leaves of a step: on the GPU, their gradients back in pinned host memory
    numba, device = _lookups(BAG_TABLES, device="cuda")
    batch = _bags(np.random.default_rng(3), 9)
    plan = device.plan(batch)
    inp, leaves = device.embed(plan, device.pull(plan), batch.dense)
    assert leaves.fused["rows"].device.type == "cuda" and leaves.fused["rows"].requires_grad
    inp.pooled.sum().backward()
    grad = leaves.grad("items")  # the fused buffer's first table: its gradient starts the pinned copy
    assert grad is not None and torch.from_numpy(grad).is_pinned()


@pytest.mark.parametrize("device_name", DEVICES)
def test_a_runner_on_the_device_path_trains_like_the_numba_path(
    synthetic_sources: dict[str, Any], tmp_path: Path, device_name: str
) -> None:
    # SGD for the dense model: its update is continuous in the gradients (Adam's first steps move each
    # weight by +-lr whatever its gradient's size, so float noise in a near-zero gradient flips it)
    config = small_run_config(
        synthetic_sources, tmp_path, **{"training.dense_optimizer": {"name": "sgd", "lr": 0.05}}
    )

    def run(device: torch.device | None) -> tuple[list[float], dict[str, torch.Tensor], Any]:
        torch.manual_seed(config.training.seed)
        shard = ParameterShard(0, builders.build_tables(config))
        model = builders.build_model_for(config).to(device or CPU)
        client = batch_lookup(
            [LocalConnection(shard)],
            np.zeros(config.ps.num_buckets, dtype=np.int64),
            table_dims={n: s.dim for n, s in builders.table_specs(config).items()},
            feature_tables=builders.feature_tables(config),
            device=device,
        )
        runner = StepRunner(model, builders.build_dense_optimizer(config, model), client)
        readers = [
            open_reader(
                DataSource.model_validate(synthetic_sources[split]), config.feature_schema(), batch_size=256
            )
            for split in ("train", "validation")
        ]
        try:
            losses = [result.loss for result in runner.run(iter(readers[0]), first_step=0, max_steps=5)]
            runner.close()
            scores = runner.predict(next(iter(readers[1])))
        finally:
            for reader in readers:
                reader.close()
        return losses, host_copy(model.state_dict()), (scores, shard.table_rows())

    losses, state, (scores, rows) = run(None)
    device_losses, device_state, (device_scores, device_rows) = run(torch.device(device_name))
    assert len(losses) == 5 and isinstance(device_scores, np.ndarray)
    # CPU: the same operations in the same order; GPU: other kernels, float32 within tolerance
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if device_name == "cpu" else {"rtol": 1e-3, "atol": 1e-4}
    np.testing.assert_allclose(device_losses, losses, rtol=tolerance["rtol"])
    np.testing.assert_allclose(device_scores, scores, **tolerance)
    for name, value in state.items():
        torch.testing.assert_close(device_state[name], value, **tolerance)
    for table, (ids, values) in rows.items():
        np.testing.assert_array_equal(device_rows[table][0], ids)
        np.testing.assert_allclose(device_rows[table][1], values, **tolerance)
