"""The systems of `psrec bench` that are plain PyTorch programs (no psrec runtime).

- `run_pytorch`: (a) the baseline a user would write: one ``nn.EmbeddingBag(sparse=True)`` per table,
  ``torch.optim.Adagrad`` (one accumulator per element) on the tables, or with ``rowwise=True`` the
  row-wise Adagrad that psrec and TorchRec use (`RowWiseAdagrad`), ``Adam`` on the MLPs; fp32, or
  with ``bf16=True`` the forward under bf16 autocast (tables and optimizer states stay fp32).
- `run_torchrec`: (b) TorchRec's ``FusedEmbeddingBagCollection`` (FBGEMM's batched tables, exact
  row-wise Adagrad fused into backward), when ``torchrec`` + ``fbgemm-gpu-cpu`` import; an optional
  extra, never a psrec dependency: without it the system reports ``skipped: <reason>``. ``bf16=True``
  runs the dense model under bf16 autocast (fp32 tables, as psrec's bf16 systems); ``fp16_rows=True``
  stores the tables in fp16 (``EmbeddingBagConfig.data_type``), skipped where TorchRec ignores it.
- `run_ceiling`: (e) the dense-only ceiling: the same DLRM fed embedding rows that are already pooled
  (random (B, F, D) tensors), so only MLPs + interaction + Adam run (backward includes the gradient of
  those rows, which any embedding system needs) — in fp32 or under bf16 autocast,
  eager or compiled as psrec's `training.compile` does (`compile_dense_model`). No embedding system
  can beat it on this machine at the same settings.

The fixed-size tables of (a) and (b) get one row per distinct id (`assign_rows`), as psrec's hash
tables do, instead of ``ids % size``, whose collisions make distinct ids share a row (as many ids as
rows leave 37% of the rows unused) and cost AUC that psrec does not pay. Each takes a `Workload` and
the data sources and returns a result dict (see `timed_loop`). All inputs are turned into tensors
(ids into row numbers) before timing starts; `workload.warmup_steps` untimed steps come first (a
compiled model compiles in the first of them).

Plain PyTorch and the ceiling run on `workload.device`: on "cuda" the tables, the model and every
batch are on the GPU before timing starts, and each step is timed until the GPU has finished it.
TorchRec runs on the CPU (its result says so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, overload

import numpy as np
import torch
from torch import nn

from psrec.bench.workload import TensorBatch, Workload, build_dlrm, load_batches, peak_rss_bytes, set_threads
from psrec.models.base import ModelInput

logger = logging.getLogger(__name__)


def timed_loop(workload: Workload, batches: list[TensorBatch], step: Callable[[TensorBatch], None]) -> dict:
    """Run warm-up then timed steps over `batches` (cycled): samples/s (wall and per CPU-second).
    On a GPU (`workload.device`) each step counts until the GPU has finished its work."""
    device = torch.device(workload.device)

    def finished() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for index in range(workload.warmup_steps):
        step(batches[index % len(batches)])
    finished()
    start, cpu_start = time.perf_counter(), time.process_time()
    samples = 0
    step_rates = []
    for index in range(workload.warmup_steps, workload.total_steps):
        batch = batches[index % len(batches)]
        began = time.perf_counter()
        step(batch)
        finished()
        step_rates.append(batch.batch_size / (time.perf_counter() - began))
        samples += batch.batch_size
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "samples_per_second": samples / seconds,
        "samples_per_cpu_second": samples / max(cpu_seconds, 1e-9),
        "best_step_samples_per_second": max(step_rates),
        "timed_seconds": seconds,
        "timed_samples": samples,
        "device": device.type,
    }


def _evaluate(predict: Callable[[TensorBatch], torch.Tensor], batches: list[TensorBatch]) -> float:
    from psrec.trainer.metrics import auc

    scores, labels = [], []
    with torch.no_grad():
        for batch in batches:
            scores.append(predict(batch).float().cpu().numpy())
            labels.append(batch.labels.cpu().numpy())
    return auc(np.concatenate(labels), np.concatenate(scores))


def assign_rows(splits: list[list[TensorBatch]], minimum_sizes: list[int]) -> list[int]:
    """Give every distinct id of a feature its own row: rewrite the batches' ids (in place) as row numbers.

    Row numbers follow the sorted distinct ids of the feature over all `splits` (train and
    validation), so no two ids share a row, as in psrec's hash tables (an id seen only in validation
    keeps its initial row there too). Returns the table sizes: the number of distinct ids, or
    `minimum_sizes` where larger (the fixed-size systems allocate the rows psrec reserves).

        >>> batch = TensorBatch(dense, labels, ids=[torch.tensor([7, 107, 7])], offsets=..., lengths=...)
        >>> assign_rows([[batch]], [100]), batch.ids[0]       # 7 and 107 collide under `% 100`
        ([100], tensor([0, 1, 0]))
    """
    batches = [batch for split in splits for batch in split]
    sizes = []
    for feature, minimum in enumerate(minimum_sizes):
        distinct = torch.unique(torch.cat([batch.ids[feature] for batch in batches]))  # sorted
        for batch in batches:
            batch.ids[feature] = torch.searchsorted(distinct, batch.ids[feature])
        sizes.append(max(minimum, int(distinct.numel())))
    return sizes


def _inputs(
    workload: Workload, sources: dict[str, Any]
) -> tuple[list[TensorBatch], list[TensorBatch], list[int]]:
    """Train and validation batches with ids as row numbers (`assign_rows`), and the table sizes."""
    train = load_batches(
        sources["train"], workload, batch_size=workload.batch_size, max_batches=workload.total_steps
    )
    validation = (
        load_batches(sources["validation"], workload, batch_size=16384) if "validation" in sources else []
    )
    return train, validation, assign_rows([train, validation], workload.table_sizes())


# -- (a) plain PyTorch ----------------------------------------------------------------------------
class PlainEmbeddings(nn.Module):
    """One EmbeddingBag per table, fed row numbers (`assign_rows`); ids past a table wrap with `%`."""

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


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad in plain PyTorch, the rule of psrec's ``rowwise_adagrad`` and FBGEMM's::

        a[r] += mean_j(g[r, j] ** 2);   w[r] -= lr * g[r] / (sqrt(a[r]) + eps)

    with one float32 accumulator per row (``torch.optim.Adagrad`` keeps one per element). A sparse
    gradient's duplicate rows are summed first (``coalesce``), as psrec's push sums duplicate ids; a
    dense gradient steps every row.
    """

    def __init__(self, params: Any, *, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:
                    continue
                state = self.state[weight]
                if "accumulator" not in state:
                    state["accumulator"] = torch.zeros(
                        weight.shape[0], dtype=torch.float32, device=weight.device
                    )
                accumulator = state["accumulator"]
                grad = weight.grad
                if grad.is_sparse:
                    grad = grad.coalesce()
                    rows, values = grad.indices()[0], grad.values()  # (n,), (n, D)
                else:
                    rows, values = torch.arange(weight.shape[0], device=weight.device), grad
                touched = accumulator[rows] + values.float().square().mean(dim=1)  # (n,)
                accumulator[rows] = touched
                scale = -group["lr"] / (touched.sqrt() + group["eps"])
                weight.index_add_(0, rows, (values * scale.unsqueeze(1)).to(weight.dtype))
        return loss


def run_pytorch(
    workload: Workload, sources: dict[str, Any], *, bf16: bool = False, rowwise: bool = False
) -> dict[str, Any]:
    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    device = torch.device(workload.device)
    model = build_dlrm(workload).to(device)  # first after seeding: the same dense init as psrec's trainer
    train, validation, sizes = _inputs(workload, sources)
    train, validation = [b.to(device) for b in train], [b.to(device) for b in validation]
    embeddings = PlainEmbeddings(sizes, workload.dim, workload.init_scale).to(device)
    sparse_optimizer: torch.optim.Optimizer = (
        RowWiseAdagrad(embeddings.parameters(), lr=workload.sparse_lr)
        if rowwise
        else torch.optim.Adagrad(embeddings.parameters(), lr=workload.sparse_lr)
    )
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)

    def step(batch: TensorBatch) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(ModelInput(batch.dense, embeddings(batch)), batch.labels)
        sparse_optimizer.zero_grad()
        dense_optimizer.zero_grad()
        loss.float().backward()
        sparse_optimizer.step()
        dense_optimizer.step()

    def predict(batch: TensorBatch) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return model.predict(ModelInput(batch.dense, embeddings(batch)))

    result = timed_loop(workload, train, step)
    result["training_peak_rss_bytes"] = peak_rss_bytes()  # before evaluation
    model.eval()
    result["auc"] = _evaluate(predict, validation)
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


def torchrec_collection(workload: Workload, sizes: list[int], *, fp16_rows: bool = False) -> Any:
    """TorchRec's ``FusedEmbeddingBagCollection`` of one table per feature (C1.., row counts `sizes`),
    row-wise Adagrad fused into backward, rows uniform in [-init_scale, init_scale] as psrec's and
    plain PyTorch's. The fused collection ignores ``EmbeddingBagConfig.init_fn`` (its FBGEMM tables
    start uniform in +-sqrt(1 / rows): +-0.003 for 100k rows), so the rows are written after it is
    built; its parameters are views of the fused tables."""
    import torchrec
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=f"t_C{i + 1}",
            embedding_dim=workload.dim,
            num_embeddings=size,
            feature_names=[f"C{i + 1}"],
            pooling=PoolingType.SUM,
            data_type=DataType.FP16 if fp16_rows else DataType.FP32,
        )
        for i, size in enumerate(sizes)
    ]
    collection = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": workload.sparse_lr},
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for weight in collection.parameters():
            nn.init.uniform_(weight, -workload.init_scale, workload.init_scale)
    return collection


def run_torchrec(
    workload: Workload, sources: dict[str, Any], *, bf16: bool = False, fp16_rows: bool = False
) -> dict[str, Any]:
    reason = torchrec_unavailable()
    if reason is not None:
        return {"skipped": reason}
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    model = build_dlrm(workload)  # first after seeding: the same dense init as psrec's trainer
    train, validation, sizes = _inputs(workload, sources)
    keys = [f"C{i + 1}" for i in range(len(sizes))]
    collection = torchrec_collection(workload, sizes, fp16_rows=fp16_rows)
    table_dtypes = {weight.dtype for weight in collection.parameters()}
    if fp16_rows and table_dtypes != {torch.float16}:
        return {
            "skipped": f"this TorchRec keeps its fused tables in {table_dtypes} (data_type FP16 not applied)"
        }
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)

    def pooled(batch: TensorBatch) -> torch.Tensor:
        values = torch.cat(batch.ids)  # row numbers (`assign_rows`)
        features = KeyedJaggedTensor.from_lengths_sync(keys, values, torch.cat(batch.lengths))
        return collection(features).values().view(batch.batch_size, len(keys), workload.dim)  # (B, F, D)

    def step(batch: TensorBatch) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(ModelInput(batch.dense, pooled(batch)), batch.labels)
        dense_optimizer.zero_grad()
        loss.float().backward()  # the row-wise Adagrad update of the tables runs inside backward
        dense_optimizer.step()

    def predict(batch: TensorBatch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model.predict(ModelInput(batch.dense, pooled(batch)))

    result = timed_loop(replace(workload, device="cpu"), train, step)  # on the CPU, whatever the device
    result["training_peak_rss_bytes"] = peak_rss_bytes()  # before evaluation
    model.eval()
    result["auc"] = _evaluate(predict, validation)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


# -- (e) the dense-only ceiling -------------------------------------------------------------------
def run_ceiling(
    workload: Workload, sources: dict[str, Any], *, bf16: bool = False, compile_model: bool = False
) -> dict[str, Any]:
    set_threads(workload.threads)
    torch.manual_seed(workload.seed)
    device = torch.device(workload.device)
    model = build_dlrm(workload).to(device)
    if compile_model:
        from psrec.trainer.builders import compile_dense_model

        compile_dense_model(model)
    # As many batches as the baselines read (no batch reused within a round), each with its own
    # (B, F, D) rows, pre-gathered: cycling 2 let the 32 MiB L3 keep part of the rows of the step
    # before last, which no embedding system's freshly gathered rows enjoy (1-2% faster here).
    # Under bf16 the rows are bf16, as psrec's embedding path hands DLRM its rows. Backward computes
    # their gradient too: every embedding system needs it to train its rows.
    train = load_batches(
        sources["train"], workload, batch_size=workload.batch_size, max_batches=workload.total_steps
    )
    train = [b.to(device) for b in train]
    dtype = torch.bfloat16 if bf16 else torch.float32
    pooled = [
        (torch.rand(b.batch_size, workload.num_sparse, workload.dim) * 0.1).to(device, dtype).requires_grad_()
        for b in train
    ]
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)
    pairs = dict(zip((id(b) for b in train), pooled, strict=True))

    def step(batch: TensorBatch) -> None:
        rows = pairs[id(batch)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
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
