"""Where a psrec step's CPU goes, next to plain PyTorch and the dense-only ceiling (1 thread, CPU time).

Drives psrec's own `StepRunner` pieces (in-process runtime, batches read beforehand) and times each
with `time.thread_time()` under 1 torch/numba thread: CPU time of one thread is what other jobs on a
shared machine disturb least, so these numbers are stable where wall-clock rates are not. Prints
milliseconds of CPU per step (median of `--reps`) for psrec, plain PyTorch and the ceiling (fp32 and
bf16 autocast), and the dense pieces (bottom MLP, interaction, top MLP) forward and forward+backward.

    python -m psrec.bench.cpu_profile --dim 64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from psrec.bench.workload import Workload, build_dlrm, load_batches, prepare_sources, set_threads
from psrec.models.base import ModelInput
from psrec.trainer.lookup import RowLeaves


def cpu_ms(fn: Callable[[int], Any], *, reps: int = 5, warmup: int = 1) -> float:
    """Median CPU milliseconds (this thread) of `fn(i)` over `reps` calls after `warmup` calls."""
    for i in range(warmup):
        fn(i)
    values = []
    for i in range(reps):
        start = time.thread_time()
        fn(warmup + i)
        values.append(time.thread_time() - start)
    return 1000 * float(np.median(values))


def profile_psrec(workload: Workload, sources: dict[str, Any], reps: int) -> dict[str, float]:
    import tempfile

    from psrec.bench.psrec_systems import PsrecLayout, bench_config
    from psrec.config import parse_config
    from psrec.data.reader import open_reader
    from psrec.data.schema import DataSource
    from psrec.train.runtime import LocalRuntime

    with tempfile.TemporaryDirectory(prefix="psrec-cpu-profile-") as tmp:
        config = parse_config(bench_config(workload, f"{tmp}/run", PsrecLayout("local", trainer_threads=1)))
        runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    reader = open_reader(
        DataSource.model_validate(sources["train"]), config.feature_schema(), batch_size=workload.batch_size
    )
    batches = [batch for _, batch in zip(range(4), reader, strict=False)]
    reader.close()
    runner, client = runtime.trainer.runner, runtime.trainer.client
    model: Any = runtime.trainer.model  # a DLRM (nn.Module-typed on the worker)
    optimizer = runtime.trainer.optimizer
    for _ in runner.run(iter(batches[:3]), first_step=0, max_steps=3):  # warm: tables, numba, torch
        pass
    batch = batches[3]
    labels = torch.from_numpy(np.array(batch.labels, dtype=np.float32))
    out: dict[str, float] = {}
    plan = client.plan(batch)
    out["plan"] = cpu_ms(lambda _: client.plan(batch), reps=reps)
    pulled = client.pull(plan)
    out["pull"] = cpu_ms(lambda _: client.pull(plan), reps=reps)
    out["embed forward"] = cpu_ms(lambda _: client.embed(plan, pulled, batch.dense), reps=reps)

    def forward(_: int) -> tuple[torch.Tensor, RowLeaves]:
        inp, leaves = client.embed(plan, pulled, batch.dense)
        return model.loss(inp, labels)[0], leaves

    def forward_backward(_: int) -> RowLeaves:
        loss, leaves = forward(0)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        return leaves

    with_forward = cpu_ms(forward, reps=reps)
    out["model forward"] = with_forward - out["embed forward"]
    out["backward"] = cpu_ms(forward_backward, reps=reps) - with_forward
    leaves = forward_backward(0)
    steps = iter(range(1_000_000, 2_000_000))
    out["push"] = cpu_ms(
        lambda _: [h.result() for h in client.submit_push(plan, leaves, step=next(steps))], reps=reps
    )
    out["adam"] = cpu_ms(lambda _: optimizer.step(), reps=reps)
    out["total"] = sum(out.values())
    return out


def profile_pytorch(workload: Workload, sources: dict[str, Any], reps: int) -> dict[str, float]:
    from psrec.bench.torch_systems import PlainEmbeddings

    batches = load_batches(sources["train"], workload, batch_size=workload.batch_size, max_batches=4)
    model = build_dlrm(workload)
    embeddings = PlainEmbeddings(workload.table_sizes(), workload.dim, workload.init_scale)
    sparse = torch.optim.Adagrad(embeddings.parameters(), lr=workload.sparse_lr)
    dense = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)
    parts: dict[str, list[float]] = {}

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        marks = [time.thread_time()]
        pooled = embeddings(batch)
        marks.append(time.thread_time())
        loss, _ = model.loss(ModelInput(batch.dense, pooled), batch.labels)
        marks.append(time.thread_time())
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        marks.append(time.thread_time())
        sparse.step()
        marks.append(time.thread_time())
        dense.step()
        marks.append(time.thread_time())
        for name, a, b in zip(
            ("embed forward", "model forward", "backward", "sparse adagrad", "adam"),
            marks,
            marks[1:],
            strict=False,
        ):
            parts.setdefault(name, []).append(1000 * (b - a))

    total = cpu_ms(step, reps=reps)
    return {name: float(np.median(values)) for name, values in parts.items()} | {"total": total}


def profile_ceiling(workload: Workload, reps: int) -> dict[str, float]:
    torch.manual_seed(workload.seed)
    model = build_dlrm(workload)
    optimizer = torch.optim.Adam(model.parameters(), lr=workload.dense_lr)
    b = workload.batch_size
    dense, pooled = torch.rand(b, 13) * 3, torch.rand(b, 26, workload.dim) * 0.1
    labels = (torch.rand(b) < 0.25).float()

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(ModelInput(dense, pooled), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    out = {
        "step fp32": cpu_ms(lambda _: step(False), reps=reps),
        "step bf16": cpu_ms(lambda _: step(True), reps=reps),
    }
    assert model.bottom is not None
    bottom_out = model.bottom(dense).detach()
    z = model.interaction(bottom_out, pooled).detach()
    pieces: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {
        "bottom MLP": (model.bottom, [dense]),
        "interaction": (model.interaction, [bottom_out, pooled]),
        "top MLP": (model.top, [z]),
    }
    for precision in ("fp32", "bf16"):
        enabled = precision == "bf16"
        for name, (fn, inputs) in pieces.items():

            def forward_backward(
                _: int, fn: Callable[..., torch.Tensor] = fn, inputs: list = inputs, enabled: bool = enabled
            ) -> None:
                leaves = [x.detach().requires_grad_() for x in inputs]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                    result = fn(*leaves)
                result.float().sum().backward()

            out[f"{name} fwd+bwd {precision}"] = cpu_ms(forward_backward, reps=reps)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    set_threads(1)
    workload = Workload(dim=args.dim, threads=1)
    sources = prepare_sources(workload)
    results = {
        "psrec": profile_psrec(workload, sources, args.reps),
        "plain PyTorch": profile_pytorch(workload, sources, args.reps),
        "dense-only ceiling": profile_ceiling(workload, args.reps),
    }
    print(f"CPU ms per step of {workload.batch_size} (1 thread, median of {args.reps}), dim {args.dim}")
    for system, values in results.items():
        print(f"{system}:")
        for name, value in values.items():
            print(f"  {name:28s} {value:8.1f}")


if __name__ == "__main__":
    main()
