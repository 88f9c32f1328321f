"""Fused sparse optimizers against dense PyTorch references and the plain NumPy formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.embedding.optimizers import aggregate_gradients
from psrec.testing.embedding_reference import ReferenceTable

DIM = 8
NUM_IDS = 12


def _batches(seed: int, steps: int, *, touch_all: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random (ids, grads) batches over ids 0..NUM_IDS-1 with heavy duplicates."""
    generator = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        positions = generator.integers(0, NUM_IDS, size=20)
        if touch_all:
            positions = np.concatenate([positions, np.arange(NUM_IDS)])
        ids = (positions * 7919 - 50).astype(np.int64)  # negative and positive ids
        grads = generator.normal(size=(ids.shape[0], DIM)).astype(np.float32)
        batches.append((ids, grads))
    return batches


def _all_ids() -> np.ndarray:
    return (np.arange(NUM_IDS) * 7919 - 50).astype(np.int64)


def _run_torch(spec: SparseOptimizerSpec, batches, make_optimizer) -> np.ndarray:
    """Dense parameter over all ids, stepped by ``torch.optim`` with scattered (summed) gradients."""
    reference_table = EmbeddingTable("init", DIM, optimizer=spec)
    ids = _all_ids()
    weight = torch.nn.Parameter(torch.from_numpy(reference_table.pull(ids, train=False).copy()))
    position_of = {int(key): position for position, key in enumerate(ids)}
    optimizer = make_optimizer([weight])
    for batch_ids, grads in batches:
        dense = torch.zeros_like(weight)
        index = torch.tensor([position_of[int(key)] for key in batch_ids])
        dense.index_add_(0, index, torch.from_numpy(grads))
        weight.grad = dense
        optimizer.step()
    return weight.detach().numpy()


def _run_table(spec: SparseOptimizerSpec, batches, **options) -> np.ndarray:
    table = EmbeddingTable("optim", DIM, optimizer=spec, **options)
    table.pull(_all_ids())
    for step, (ids, grads) in enumerate(batches, start=1):
        table.push(ids, grads, step=step)
    return table.pull(_all_ids(), train=False)


@pytest.mark.parametrize(
    ("spec", "make_optimizer"),
    [
        (SparseOptimizerSpec("sgd", lr=0.05), lambda params: torch.optim.SGD(params, lr=0.05)),
        (
            SparseOptimizerSpec("adagrad", lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
            lambda params: torch.optim.Adagrad(params, lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
        ),
    ],
    ids=["sgd", "adagrad"],
)
def test_matches_torch_optim_on_touched_rows(spec, make_optimizer) -> None:
    batches = _batches(0, 6)
    expected = _run_torch(spec, batches, make_optimizer)
    np.testing.assert_allclose(_run_table(spec, batches), expected, rtol=1e-5, atol=1e-6)


def test_adam_matches_torch_adam_when_every_row_is_touched_every_step() -> None:
    spec = SparseOptimizerSpec("adam", lr=0.01, eps=1e-8, beta1=0.9, beta2=0.99)
    batches = _batches(1, 6, touch_all=True)
    expected = _run_torch(
        spec, batches, lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    )
    np.testing.assert_allclose(_run_table(spec, batches), expected, rtol=1e-5, atol=1e-6)


def test_non_lazy_adam_matches_dense_torch_adam_with_weight_decay_on_partial_batches() -> None:
    # The batches touch only some rows: lazy Adam would leave the others alone, dense torch Adam moves
    # them with their moments and weight decay. lazy=False must reproduce the dense result.
    spec = SparseOptimizerSpec("adam", lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.05, lazy=False)
    batches = [(ids[:4], grads[:4]) for ids, grads in _batches(3, 8)]
    expected = _run_torch(
        spec,
        batches,
        lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.05),
    )
    np.testing.assert_allclose(_run_table(spec, batches), expected, rtol=1e-5, atol=1e-6)
    lazy = SparseOptimizerSpec("adam", lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.05)
    assert np.abs(_run_table(lazy, batches) - expected).max() > 1e-3


def test_non_lazy_update_reaches_low_precision_rows() -> None:
    spec = SparseOptimizerSpec("sgd", lr=0.5, weight_decay=0.5, lazy=False)
    table = EmbeddingTable("decay", DIM, optimizer=spec, precision="fp16")
    before = table.pull(_all_ids()).copy()
    table.push(_all_ids()[:1], np.zeros((1, DIM), dtype=np.float32), step=1)
    after = table.pull(_all_ids(), train=False)
    np.testing.assert_allclose(after, before * 0.75, rtol=2e-3, atol=1e-6)  # w -= 0.5 * 0.5 * w


def test_adagrad_weight_decay_matches_torch_when_every_row_is_touched() -> None:
    spec = SparseOptimizerSpec("adagrad", lr=0.1, eps=1e-10, weight_decay=0.01)
    batches = _batches(2, 5, touch_all=True)
    expected = _run_torch(
        spec, batches, lambda params: torch.optim.Adagrad(params, lr=0.1, eps=1e-10, weight_decay=0.01)
    )
    np.testing.assert_allclose(_run_table(spec, batches), expected, rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_matches_the_torch_formula() -> None:
    spec = SparseOptimizerSpec("rowwise_adagrad", lr=0.1)
    batches = _batches(3, 6)
    table = EmbeddingTable("init", DIM, optimizer=spec)
    ids = _all_ids()
    weight = torch.from_numpy(table.pull(ids, train=False).copy())
    accumulator = torch.zeros(NUM_IDS)
    position_of = {int(key): position for position, key in enumerate(ids)}
    for batch_ids, grads in batches:
        dense = torch.zeros_like(weight)
        index = torch.tensor([position_of[int(key)] for key in batch_ids])
        dense.index_add_(0, index, torch.from_numpy(grads))
        touched = torch.unique(index)
        accumulator[touched] += dense[touched].pow(2).mean(dim=1)
        weight[touched] -= 0.1 * dense[touched] / (accumulator[touched].sqrt() + 1e-8)[:, None]
    np.testing.assert_allclose(_run_table(spec, batches), weight.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "spec",
    [
        SparseOptimizerSpec("sgd", lr=0.05, weight_decay=0.1),
        SparseOptimizerSpec("adagrad", lr=0.1, weight_decay=0.01),
        SparseOptimizerSpec("rowwise_adagrad", lr=0.1, weight_decay=0.01, initial_accumulator_value=0.5),
        SparseOptimizerSpec("adam", lr=0.01, weight_decay=0.01),
        SparseOptimizerSpec(
            "ftrl", lr=0.1, ftrl_beta=1.0, ftrl_l1=0.5, ftrl_l2=0.1, initial_accumulator_value=0.1
        ),
        SparseOptimizerSpec("ftrl", lr=0.05),
    ],
    ids=["sgd", "adagrad", "rowwise_adagrad", "lazy_adam", "ftrl_l1_l2", "ftrl_plain"],
)
def test_lazy_updates_match_the_numpy_reference(spec) -> None:
    batches = _batches(4, 8)  # rows are touched irregularly: Adam step counts differ per row
    reference = ReferenceTable(DIM, spec)
    reference.pull(_all_ids())
    for step, (ids, grads) in enumerate(batches, start=1):
        reference.push(ids, grads, step=step)
    np.testing.assert_allclose(
        _run_table(spec, batches), reference.pull(_all_ids(), train=False), rtol=1e-4, atol=1e-5
    )


def test_ftrl_l1_produces_exact_zeros() -> None:
    spec = SparseOptimizerSpec("ftrl", lr=0.1, ftrl_l1=100.0)
    rows = _run_table(spec, _batches(5, 3))
    touched = np.unique(np.concatenate([ids for ids, _ in _batches(5, 3)]))
    assert touched.size > 0
    assert np.count_nonzero(rows == 0.0) >= touched.size * DIM


def test_aggregate_gradients_sums_duplicates_and_drops_absent_rows() -> None:
    rows = np.array([3, -1, 3, 7, 3], dtype=np.int32)
    grads = np.arange(10, dtype=np.float32).reshape(5, 2)
    unique_rows, summed, summed_rows, occurrences, finite = aggregate_gradients(rows, grads)
    assert finite
    order = np.argsort(unique_rows)
    np.testing.assert_array_equal(unique_rows[order], [3, 7])
    np.testing.assert_array_equal(summed[summed_rows][order], [[0 + 4 + 8, 1 + 5 + 9], [6, 7]])
    np.testing.assert_array_equal(occurrences[order], [3, 1])
    unique_rows, same, same_rows, occurrences, finite = aggregate_gradients(rows[1:4], grads[1:4])
    assert np.shares_memory(same, grads)  # no duplicates: no copy
    np.testing.assert_array_equal(unique_rows, [3, 7])
    np.testing.assert_array_equal(same[same_rows], grads[[2, 3]])
    for bad in (np.nan, np.inf, -np.inf):
        broken = grads.copy()
        broken[1, 0] = bad  # even the gradient of an absent row is checked
        assert not aggregate_gradients(rows, broken)[4]
