"""psrec against an oracle that is not psrec: the same model trained by a plain PyTorch loop.

The oracle holds every table as a dense `nn.Embedding` (the test maps each id to a row index),
initialised with psrec's deterministic initial value of (table seed, id) computed by the embedding
engine's NumPy reference (`initial_rows_numpy`), and the dense model built under the same torch
seed. It steps the rows with `torch.optim.SGD` / `torch.optim.Adagrad` and a row-wise Adagrad
written here, and the dense model with `torch.optim.Adam`. The batches come from psrec's reader (the
data path has its own tests); from the ids on, nothing of psrec's routing, shards, pull / push,
pooling or sparse optimizers is used.

psrec trains the same config in process (`LocalRuntime`, 2 shards) and on Ray (1 trainer + 2 shard
actors, sync); per-step losses agree to 1e-5 for 50 steps, and so do the final rows and dense
weights.

    pytest tests/train/test_torch_oracle.py            # in process, a few seconds
    pytest tests/train/test_torch_oracle.py -m ray     # adds the Ray run
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from psrec.config import RunConfig
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.embedding.initializers import initial_rows_numpy
from psrec.models.base import ModelInput
from psrec.trainer import builders
from tests.conftest import small_run_config

STEPS = 50
BATCH = 32
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 2e-6
ROW_OPTIMIZERS = {"C1": "sgd", "C2": "rowwise_adagrad"}  # the other tables: the default, adagrad


@pytest.fixture(scope="module")
def oracle_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from psrec.data.synth import write_synthetic_criteo

    root = tmp_path_factory.mktemp("oracle")
    write_synthetic_criteo(
        root / "train", rows=STEPS * BATCH, seed=7, cardinality_scale=0.002, row_group_rows=400
    )
    return {"train": {"format": "parquet", "paths": [str(root / "train" / "*.parquet")]}}


def oracle_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> RunConfig:
    """A tiny DLRM (26 tables of dim 4); three sparse optimizers and a uniform initializer in the mix."""
    # Adagrad accumulators start at 1e-6: a row whose squared gradients sum to about eps**2 would
    # step by about lr * sign(g), and float noise in a near-zero g would flip it (ill-conditioned).
    adagrad = {"name": "adagrad", "lr": 0.05, "initial_accumulator_value": 1e-6}
    tables = {
        name: {"dim": 4, "optimizer": {"name": optimizer, "lr": 0.2, "initial_accumulator_value": 1e-6}}
        for name, optimizer in ROW_OPTIMIZERS.items()
    }
    tables["C3"] = {"dim": 4, "optimizer": adagrad, "initializer": {"kind": "uniform", "scale": 0.05}}
    settings: dict[str, Any] = {
        "model": {"name": "dlrm", "bottom_hidden_sizes": [8], "top_hidden_sizes": [8]},
        "embedding.default": {"dim": 4, "optimizer": adagrad},
        "embedding.tables": tables,
        "training.batch_size": BATCH,
        "training.dense_optimizer": {"name": "adam", "lr": 0.003},
    }
    return small_run_config(sources, run_dir, **(settings | overrides))


@dataclass
class Trained:
    losses: np.ndarray  # (steps,) mean loss of each step
    dense: dict[str, torch.Tensor]
    rows: dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (sorted ids, (n, dim) rows)
    initial_rows: dict[str, np.ndarray] | None = None


class RowWiseAdagrad:
    """``a += mean(g**2)`` per row; ``w -= lr * g / (sqrt(a) + eps)``, on a dense weight."""

    def __init__(
        self, weight: torch.Tensor, *, lr: float, eps: float, initial_accumulator_value: float
    ) -> None:
        self.weight, self.lr, self.eps = weight, lr, eps
        self.accumulator = torch.full((weight.shape[0],), initial_accumulator_value)

    @torch.no_grad()
    def step(self) -> None:
        grad = self.weight.grad
        assert grad is not None
        self.accumulator += grad.pow(2).mean(dim=1)
        self.weight -= self.lr * grad / (self.accumulator.sqrt() + self.eps)[:, None]


def row_optimizer(name: str, weight: torch.Tensor, *, lr: float, eps: float, accumulator: float) -> Any:
    if name == "sgd":
        return torch.optim.SGD([weight], lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad([weight], lr=lr, eps=eps, initial_accumulator_value=accumulator)
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(weight, lr=lr, eps=eps, initial_accumulator_value=accumulator)
    raise ValueError(f"the oracle has no {name!r}")


def train_torch_oracle(config: RunConfig, sources: dict[str, Any], steps: int) -> Trained:
    """The plain PyTorch loop (see the module docstring)."""
    schema = config.feature_schema()
    reader = open_reader(
        DataSource.model_validate(sources["train"]),
        schema,
        batch_size=config.training.batch_size,
        seed=config.training.seed * 1000,  # epoch 0, as the trainer opens it
    )
    batches = [batch for _, batch in zip(range(steps), reader, strict=False)]
    reader.close()
    assert len(batches) == steps
    table_of = {feature.name: feature.table for feature in schema.sparse}
    vocabulary: dict[str, np.ndarray] = {}  # table -> sorted ids; an id's row index is its position
    for table in sorted(set(table_of.values())):
        keys = [key for key, owner in table_of.items() if owner == table]
        vocabulary[table] = np.unique(
            np.concatenate([batch.sparse.feature(key)[0] for batch in batches for key in keys])
        )
    specs = {spec.name: spec for spec in builders.shard_table_specs(config)}  # seeds and initializers
    torch.manual_seed(config.training.seed)  # the trainer's dense init
    model = builders.build_model_for(config)
    dense_spec = config.training.dense_optimizer
    optimizers: list[Any] = [torch.optim.Adam(model.parameters(), lr=dense_spec.lr)]
    embeddings: dict[str, torch.nn.Embedding] = {}
    initial: dict[str, np.ndarray] = {}
    for table, ids in vocabulary.items():
        spec = specs[table]
        initial[table] = initial_rows_numpy(ids, spec.dim, spec.initializer, spec.seed)
        embeddings[table] = torch.nn.Embedding.from_pretrained(torch.tensor(initial[table]), freeze=False)
        settings = config.table_config(table).optimizer
        optimizers.append(
            row_optimizer(
                settings.name,
                embeddings[table].weight,
                lr=settings.lr,
                eps=settings.eps,
                accumulator=settings.initial_accumulator_value,
            )
        )
    parameters = [*model.parameters(), *(embedding.weight for embedding in embeddings.values())]
    losses = []
    for batch in batches:
        pooled = []
        for key in batch.sparse.keys:
            ids, lengths = batch.sparse.feature(key)
            table = table_of[key]
            index = torch.from_numpy(np.searchsorted(vocabulary[table], ids))
            if (lengths == 1).all():
                pooled.append(embeddings[table](index))  # (B, D)
                continue
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]))
            pooled.append(F.embedding_bag(index, embeddings[table].weight, offsets, mode="sum"))
        inp = ModelInput(torch.from_numpy(batch.dense.copy()), torch.stack(pooled, dim=1))  # (B, F, D)
        logits = model(inp)
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels.copy()))
        for parameter in parameters:
            parameter.grad = None
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(float(loss.detach()))
    rows = {
        table: (ids, embeddings[table].weight.detach().numpy().copy()) for table, ids in vocabulary.items()
    }
    dense = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return Trained(np.array(losses), dense, rows, initial)


def train_psrec(runtime_class: Any, config: RunConfig, sources: dict[str, Any], steps: int) -> Trained:
    """psrec, one step per driver call so that every step's loss comes back."""
    runtime = runtime_class(config, base_dir=".", data_sources=sources)
    try:
        runtime.start_epoch(0)
        losses = []
        for _ in range(steps):
            [result] = runtime.train_steps(1)
            assert result.steps == 1
            losses.append(result.loss_sum / result.samples)
        return Trained(np.array(losses), runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


@pytest.fixture(scope="module")
def oracle(oracle_sources: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Trained:
    config = oracle_config(oracle_sources, tmp_path_factory.mktemp("oracle-run"))
    return train_torch_oracle(config, oracle_sources, STEPS)


def assert_equals_oracle(run: Trained, oracle: Trained) -> None:
    """Losses to 1e-5, final weights to 2e-6 (measured: 1.2e-7; 1e-7 dense, 5e-7 rows): float
    rounding only, e.g. duplicate ids' gradients are summed in another order."""
    np.testing.assert_allclose(run.losses, oracle.losses, rtol=0, atol=LOSS_TOLERANCE)
    assert run.dense.keys() == oracle.dense.keys()
    for name, value in oracle.dense.items():
        torch.testing.assert_close(run.dense[name], value, rtol=0, atol=WEIGHT_TOLERANCE, msg=name)
    assert run.rows.keys() == oracle.rows.keys()
    for table, (ids, values) in oracle.rows.items():
        np.testing.assert_array_equal(run.rows[table][0], ids, err_msg=table)
        np.testing.assert_allclose(run.rows[table][1], values, rtol=0, atol=WEIGHT_TOLERANCE, err_msg=table)


def test_the_oracle_trains(oracle: Trained) -> None:
    """Not a vacuous comparison: the loss falls and every table's rows moved away from their init."""
    assert oracle.losses[-10:].mean() < oracle.losses[:10].mean()
    assert oracle.initial_rows is not None
    for table, (_, values) in oracle.rows.items():
        assert np.abs(values - oracle.initial_rows[table]).max() > 1e-3, table


def test_in_process_training_equals_a_plain_torch_loop(
    oracle_sources: dict[str, Any], oracle: Trained, tmp_path: Path
) -> None:
    from psrec.train.runtime import LocalRuntime

    config = oracle_config(oracle_sources, tmp_path, **{"ps.runtime": "local", "ps.num_shards": 2})
    assert_equals_oracle(train_psrec(LocalRuntime, config, oracle_sources, STEPS), oracle)


@pytest.mark.ray
def test_ray_training_equals_a_plain_torch_loop(
    ray_cluster: None, oracle_sources: dict[str, Any], oracle: Trained, tmp_path: Path
) -> None:
    from psrec.train.runtime import RayRuntime

    config = oracle_config(
        oracle_sources, tmp_path, **{"ps.runtime": "ray", "ps.num_trainers": 1, "ps.num_shards": 2}
    )
    assert_equals_oracle(train_psrec(RayRuntime, config, oracle_sources, STEPS), oracle)
