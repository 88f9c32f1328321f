"""The plain PyTorch and TorchRec bench systems: collision-free rows, row-wise Adagrad, bf16 variants.

Run: `python -m pytest tests/bench/test_torch_systems.py -q` (a few seconds; no timing asserts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from psrec.bench.harness import run_bench
from psrec.bench.torch_systems import (
    PlainEmbeddings,
    RowWiseAdagrad,
    assign_rows,
    torchrec_collection,
    torchrec_unavailable,
)
from psrec.bench.workload import TensorBatch, Workload
from psrec.embedding.specs import SparseOptimizerSpec
from psrec.testing.embedding_reference import new_state, reference_step
from tests.bench.test_bench import tiny_workload


def one_hot_batch(*features: list[int]) -> TensorBatch:
    """A batch with one id per sample and feature (bags of one), dense and labels zero."""
    size = len(features[0])
    return TensorBatch(
        dense=torch.zeros(size, 13),
        labels=torch.zeros(size),
        ids=[torch.tensor(ids, dtype=torch.int64) for ids in features],
        offsets=[torch.arange(size, dtype=torch.int64) for _ in features],
        lengths=[torch.ones(size, dtype=torch.int64) for _ in features],
    )


def test_assign_rows_gives_ids_that_collide_under_modulo_their_own_rows() -> None:
    train = one_hot_batch([7, 107, 7], [1, 2, 3])
    validation = one_hot_batch([207, 7, 107], [3, 4, 1])
    sizes = assign_rows([[train], [validation]], [100, 2])
    assert train.ids[0].tolist() == [0, 1, 0] and validation.ids[0].tolist() == [2, 0, 1]
    assert train.ids[1].tolist() == [0, 1, 2] and validation.ids[1].tolist() == [2, 3, 0]
    assert sizes == [100, 4]  # the rows psrec reserves, or every distinct id where there are more


def test_plain_embeddings_pool_colliding_ids_apart() -> None:
    # 7 and 107 share row 7 of a 100-row table under `ids % size`; after assign_rows they do not.
    batch = one_hot_batch([7, 107])
    sizes = assign_rows([[batch]], [100])
    torch.manual_seed(0)
    pooled = PlainEmbeddings(sizes, dim=4, init_scale=0.05)(batch)  # (B, F, D)
    assert not torch.equal(pooled[0, 0], pooled[1, 0])


def test_rowwise_adagrad_matches_psrec_reference_step() -> None:
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(6, 4, mode="sum", sparse=True)
    start = bag.weight.detach().numpy().copy()
    optimizer = RowWiseAdagrad(bag.parameters(), lr=0.1)
    spec = SparseOptimizerSpec(name="rowwise_adagrad", lr=0.1, eps=1e-8)
    expected = {row: start[row].astype(np.float64) for row in range(6)}
    states = {row: new_state(spec, 4) for row in range(6)}
    ids = [torch.tensor([1, 3, 1, 4]), torch.tensor([3, 5, 3])]  # duplicates are summed first
    targets = [torch.randn(4, 4), torch.randn(3, 4)]
    for step_ids, target in zip(ids, targets, strict=True):
        optimizer.zero_grad()
        pooled = bag(step_ids, torch.arange(step_ids.numel()))
        (pooled * target).sum().backward()
        optimizer.step()
        grads: dict[int, np.ndarray] = {}
        for row, grad in zip(step_ids.tolist(), target.numpy(), strict=True):
            grads[row] = grads.get(row, 0.0) + grad.astype(np.float64)
        for row, grad in grads.items():
            expected[row] = reference_step(spec, expected[row], states[row], grad)
    got = bag.weight.detach().numpy()
    for row in range(6):
        np.testing.assert_allclose(got[row], expected[row], rtol=1e-5, atol=1e-7)
    assert optimizer.state[bag.weight]["accumulator"].shape == (6,)  # one accumulator per row


def test_bf16_and_rowwise_baselines_train(tmp_path: Path) -> None:
    systems = ["pytorch", "pytorch-bf16", "pytorch-rowwise", "pytorch-bf16-rowwise"]
    report = run_bench(tiny_workload(tmp_path / "cache"), systems, rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    for name in systems:
        assert rows[name]["status"] == "ok", (name, rows[name]["status"])
        assert rows[name]["samples_per_second"] > 0 and 0.0 <= rows[name]["auc"] <= 1.0
    assert rows["pytorch-bf16"]["precision"] == "bf16" and rows["pytorch-bf16"]["ratio_to_pytorch"] == 1.0
    assert rows["pytorch-bf16-rowwise"]["ratio_to_pytorch"] is not None  # by pytorch-bf16, not pytorch


@pytest.mark.skipif(torchrec_unavailable() is None, reason="TorchRec is installed: the variants run")
def test_torchrec_variants_are_skipped_with_the_reason(tmp_path: Path) -> None:
    systems = ["torchrec", "torchrec-bf16", "torchrec-fp16rows"]
    report = run_bench(tiny_workload(tmp_path / "cache"), systems, rounds=2, isolate=False)
    for row in report["rows"]:
        assert row["status"].startswith("skipped: ") and len(row["status"]) > len("skipped: ")
    assert len(report["runs"]) == 2 * len(systems)


@pytest.mark.skipif(torchrec_unavailable() is not None, reason="TorchRec is not installed")
def test_torchrec_rows_start_in_the_workloads_init_range() -> None:
    # Every system starts its rows uniform in [-init_scale, init_scale]: TorchRec's fused collection
    # ignores init_fn and starts at +-sqrt(1 / rows) (+-0.0316 for 1000 rows) unless rewritten.
    workload = Workload(dim=16, init_scale=0.05)
    torch.manual_seed(0)
    collection = torchrec_collection(workload, [1000, 3000])
    weights = [weight.detach().float() for weight in collection.parameters()]
    assert [tuple(weight.shape) for weight in weights] == [(1000, 16), (3000, 16)]
    reference = torch.empty(4000 * 16).uniform_(-0.05, 0.05)  # what nn.init.uniform_ draws
    values = torch.cat([weight.reshape(-1) for weight in weights])
    assert values.abs().max() <= 0.05
    assert values.abs().max() > 0.049
    assert values.std().item() == pytest.approx(reference.std().item(), rel=0.05)
