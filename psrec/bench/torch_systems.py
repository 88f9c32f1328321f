"""The systems of `psrec bench` that are plain PyTorch programs (no psrec runtime).

- `run_pytorch`: (a) the baseline a user would write: one ``nn.EmbeddingBag(sparse=True)`` per table
  (ids hashed into the table with ``%``), ``torch.optim.Adagrad`` on the tables, ``Adam`` on the MLPs.
- `run_torchrec`: (b) TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's batched tables, exact
  row-wise Adagrad fused into backward), when ``torchrec`` + ``fbgemm-gpu-cpu`` import; an optional
  extra, never a psrec dependency: without it the system reports ``skipped: <reason>``.
- `run_ceiling`: (e) the dense-only ceiling: the same DLRM fed embedding rows that are already pooled
  (random (B, F, D) tensors), so only MLPs + interaction + Adam run (backward includes the gradient of
  those rows, which any embedding system needs) — in fp32 or under bf16 autocast,
  eager or compiled as psrec's `training.compile` does (`compile_dense_model`). No embedding system
  can beat it on this machine at the same settings.

Each takes a `Workload` and the data sources and returns a result dict (see `timed_loop`). All
inputs are turned into tensors before timing starts; `workload.warmup_steps` untimed steps come first
(a compiled model compiles in the first of them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from psrec.bench.workload import TensorBatch, Workload, build_dlrm, load_batches, peak_rss_bytes, set_threads
from psrec.models.base import ModelInput

logger = logging.getLogger(__name__)


def timed_loop(workload: Workload, batches: list[TensorBatch], step: Callable[[TensorBatch], None]) -> dict:
    """Run warm-up then timed steps over `batches` (cycled): samples/s (wall and per CPU-second)."""
    for index in range(workload.warmup_steps):
        step(batches[index % len(batches)])
    start, cpu_start = time.perf_counter(), time.process_time()
    samples = 0
    step_rates = []
    for index in range(workload.warmup_steps, workload.total_steps):
        batch = batches[index % len(batches)]
        began = time.perf_counter()
        step(batch)
        step_rates.append(batch.batch_size / (time.perf_counter() - began))
        samples += batch.batch_size
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "samples_per_second": samples / seconds,
        "samples_per_cpu_second": samples / max(cpu_seconds, 1e-9),
        "best_step_samples_per_second": max(step_rates),
        "timed_seconds": seconds,
        "timed_samples": samples,
    }


def _evaluate(predict: Callable[[TensorBatch], torch.Tensor], batches: list[TensorBatch]) -> float:
    from psrec.train.metrics import auc

    scores, labels = [], []
    with torch.no_grad():
        for batch in batches:
            scores.append(predict(batch).float().numpy())
            labels.append(batch.labels.numpy())
    return auc(np.concatenate(labels), np.concatenate(scores))


def _inputs(workload: Workload, sources: dict[str, Any]) -> tuple[list[TensorBatch], list[TensorBatch]]:
    train = load_batches(sources["train"], batch_size=workload.batch_size, max_batches=workload.total_steps)
    validation = load_batches(sources["validation"], batch_size=16384) if "validation" in sources else []
    return train, validation


# -- (a) plain PyTorch ----------------------------------------------------------------------------
class PlainEmbeddings(nn.Module):
    """One EmbeddingBag per table; ids hashed into the table with a modulo, as users do."""

    def __init__(self, sizes: list[int], dim: int, init_scale: float) -> None:
        super().__init__()
        self.sizes = sizes
        bags = [nn.EmbeddingBag(size, dim, mode="sum", sparse=True) for size in sizes]
        for bag in bags:
            nn.init.uniform_(bag.weight, -init_scale, init_scale)
        self.bags = nn.ModuleList(bags)

    def forward(self, batch: TensorBatch) -> torch.Tensor:
        pooled = [
            bag(ids % size, offsets)
            for bag, size, ids, offsets in zip(self.bags, self.sizes, batch.ids, batch.offsets, strict=True)
        ]
        return torch.stack(pooled, dim=1)  # (B, F, D)


def run_pytorch(workload: Workload, sources: dict[str, Any]) -> dict[str, Any]:
    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    model = build_dlrm(workload)  # first after seeding: the same dense init as psrec's trainer
    train, validation = _inputs(workload, sources)
    embeddings = PlainEmbeddings(workload.table_sizes(), workload.dim, workload.init_scale)
    sparse_optimizer = torch.optim.Adagrad(embeddings.parameters(), lr=workload.sparse_lr)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)

    def step(batch: TensorBatch) -> None:
        loss, _ = model.loss(ModelInput(batch.dense, embeddings(batch)), batch.labels)
        sparse_optimizer.zero_grad()
        dense_optimizer.zero_grad()
        loss.backward()
        sparse_optimizer.step()
        dense_optimizer.step()

    result = timed_loop(workload, train, step)
    model.eval()
    result["auc"] = _evaluate(lambda b: model.predict(ModelInput(b.dense, embeddings(b))), validation)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


# -- (b) TorchRec ---------------------------------------------------------------------------------
def torchrec_unavailable() -> str | None:
    """Why TorchRec cannot run here, or None when it imports."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "skip", with the reason
        return f"{type(error).__name__}: {error}".splitlines()[0][:200]
    return None


def run_torchrec(workload: Workload, sources: dict[str, Any]) -> dict[str, Any]:
    reason = torchrec_unavailable()
    if reason is not None:
        return {"skipped": reason}
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    model = build_dlrm(workload)  # first after seeding: the same dense init as psrec's trainer
    train, validation = _inputs(workload, sources)
    sizes = workload.table_sizes()
    keys = [f"C{i + 1}" for i in range(len(sizes))]
    scale = workload.init_scale
    tables = [
        EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=workload.dim,
            num_embeddings=size,
            feature_names=[key],
            pooling=PoolingType.SUM,
            init_fn=lambda weight: nn.init.uniform_(weight, -scale, scale),
        )
        for key, size in zip(keys, sizes, strict=True)
    ]
    collection = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": workload.sparse_lr},
        device=torch.device("cpu"),
    )
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)
    size_tensors = [torch.tensor(size) for size in sizes]

    def pooled(batch: TensorBatch) -> torch.Tensor:
        values = torch.cat([ids % size for ids, size in zip(batch.ids, size_tensors, strict=True)])
        features = KeyedJaggedTensor.from_lengths_sync(keys, values, torch.cat(batch.lengths))
        return collection(features).values().view(batch.batch_size, len(keys), workload.dim)  # (B, F, D)

    def step(batch: TensorBatch) -> None:
        loss, _ = model.loss(ModelInput(batch.dense, pooled(batch)), batch.labels)
        dense_optimizer.zero_grad()
        loss.backward()  # the row-wise Adagrad update of the tables runs inside backward
        dense_optimizer.step()

    result = timed_loop(workload, train, step)
    model.eval()
    result["auc"] = _evaluate(lambda b: model.predict(ModelInput(b.dense, pooled(b))), validation)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


# -- (e) the dense-only ceiling -------------------------------------------------------------------
def run_ceiling(
    workload: Workload, sources: dict[str, Any], *, bf16: bool = False, compile_model: bool = False
) -> dict[str, Any]:
    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    model = build_dlrm(workload)
    if compile_model:
        from psrec.train.builders import compile_dense_model

        compile_dense_model(model)
    # As many batches as the baselines read (no batch reused within a round), each with its own
    # (B, F, D) rows, pre-gathered: cycling 2 let the 32 MiB L3 keep part of the rows of the step
    # before last, which no embedding system's freshly gathered rows enjoy (1-2% faster here).
    # Under bf16 the rows are bf16, as psrec's embedding path hands DLRM its rows. Backward computes
    # their gradient too: every embedding system needs it to train its rows.
    train = load_batches(sources["train"], batch_size=workload.batch_size, max_batches=workload.total_steps)
    dtype = torch.bfloat16 if bf16 else torch.float32
    pooled = [(torch.rand(b.batch_size, 26, workload.dim) * 0.1).to(dtype).requires_grad_() for b in train]
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)
    pairs = dict(zip((id(b) for b in train), pooled, strict=True))

    def step(batch: TensorBatch) -> None:
        rows = pairs[id(batch)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(ModelInput(batch.dense, rows), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The rows' gradient is consumed (an embedding system hands it to its sparse optimizer) and
        # freed, so the next step's reuses its memory. Kept until the batch came round again, every
        # step of a round (each batch used once) page-faulted a fresh 13.6 MB buffer (bf16).
        rows.grad = None

    result = timed_loop(workload, train, step)
    result["auc"] = None  # random embeddings: nothing to learn
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result
