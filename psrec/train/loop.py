"""The training driver: epochs of steps on a runtime, evaluation, early stopping, metrics, summary.

`train(config)` is what `psrec train CONFIG` runs. It prepares the data (generating the synthetic
Criteo-shaped set when the config asks for it), starts the runtime (in-process or Ray), and then
loops: every trainer runs `log_every_steps` steps, the driver updates the progress bar and
TensorBoard, evaluates on the validation split at the end of each epoch (and every
`eval_every_steps`), keeps the best model under early stopping (decaying all learning rates on a
plateau), and finally evaluates the best model on validation and test and writes `summary.json`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psrec.config import RunConfig
from psrec.train.metrics import BinaryMetricAccumulator, auc, logloss
from psrec.train.runtime import Runtime, make_runtime
from psrec.train.worker import ChunkResult

logger = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    best_metric: float | None = None
    best_step: int = -1
    bad_evals: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes_pulled: int = 0
    bytes_pushed: int = 0
    row_ids: list[np.ndarray] = field(default_factory=list)


def prepare_data(
    config: RunConfig, *, base_dir: Path, run_dir: Path
) -> tuple[dict[str, dict[str, Any]], str]:
    """Data sources by split (as plain dicts) and the base dir their paths are relative to."""
    data = config.data
    if data.synthetic is not None:
        from psrec.data.synth import write_synthetic_criteo

        synthetic = data.synthetic
        directory = run_dir / "data"
        splits = {"train": synthetic.train_rows, "validation": synthetic.validation_rows}
        sources: dict[str, dict[str, Any]] = {}
        for index, (split, rows) in enumerate(splits.items()):
            if rows == 0:
                continue
            target = directory / split
            marker = target / "_SUCCESS"
            if not marker.exists():
                logger.info("generating %d synthetic Criteo-shaped rows into %s", rows, target)
                write_synthetic_criteo(
                    target,
                    rows=rows,
                    seed=synthetic.seed + index,
                    cardinality_scale=synthetic.cardinality_scale,
                )
                marker.write_text("ok\n")
            sources[split] = {"format": "parquet", "paths": [str(target.resolve() / "*.parquet")]}
        return sources, str(base_dir)
    sources = {}
    for split in ("train", "validation", "test"):
        source = getattr(data, split)
        if source is not None:
            sources[split] = source.model_dump(mode="json")
    return sources, str(base_dir)


def train(
    config: RunConfig,
    *,
    base_dir: str | Path = ".",
    progress: ProgressFn | None = None,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    """Train as `config` says; returns (and writes to RUN_DIR/summary.json) the run summary."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json", by_alias=True), indent=2))
    sources, base = prepare_data(config, base_dir=Path(base_dir), run_dir=run_dir)
    started = time.perf_counter()
    owns_runtime = runtime is None
    if runtime is None:
        runtime = make_runtime(config, base_dir=base, data_sources=sources)
    writer = _summary_writer(run_dir)
    state = TrainState()
    try:
        summary = _train_loop(config, runtime, state, sources, writer, progress)
    finally:
        if writer is not None:
            writer.close()
        if owns_runtime:
            runtime.shutdown()
    summary["wall_seconds"] = time.perf_counter() - started
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary


def _train_loop(
    config: RunConfig,
    runtime: Runtime,
    state: TrainState,
    sources: dict[str, Any],
    writer: Any,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    training = config.training
    running = BinaryMetricAccumulator(window=100_000)
    train_seconds = 0.0
    stop = False
    has_validation = "validation" in sources
    for epoch in range(training.epochs):
        runtime.start_epoch(epoch)
        exhausted = False
        while not exhausted and not stop:
            chunk = training.log_every_steps
            if training.max_steps is not None:
                chunk = min(chunk, training.max_steps - state.step)
                if chunk <= 0:
                    stop = True
                    break
            if training.eval_every_steps is not None:
                chunk = min(chunk, training.eval_every_steps - state.step % training.eval_every_steps)
            start = time.perf_counter()
            results = runtime.train_steps(chunk)
            train_seconds += time.perf_counter() - start
            exhausted = _absorb(state, results, running)
            if results[0].steps == 0:
                continue
            loss = sum(r.loss_sum for r in results) / max(1, sum(r.samples for r in results))
            report = {
                "epoch": epoch,
                "step": state.step,
                "samples": state.samples,
                "loss": loss,
                "running_auc": running.compute()["auc"] if len(running) else float("nan"),
                "samples_per_second": state.samples / max(train_seconds, 1e-9),
            }
            _scalars(writer, "train", report, state.step)
            if progress is not None:
                progress(report)
            due = training.eval_every_steps is not None and state.step % training.eval_every_steps == 0
            if has_validation and due and not exhausted:
                stop = _evaluate_and_decide(config, runtime, state, writer, epoch)
        if has_validation and not stop:
            stop = _evaluate_and_decide(config, runtime, state, writer, epoch)
        if stop:
            break
    if state.best_step >= 0 and training.early_stopping is not None:
        runtime.restore_snapshot("best")
    summary: dict[str, Any] = {
        "steps": state.step,
        "samples": state.samples,
        "train_seconds": train_seconds,
        "samples_per_second": state.samples / max(train_seconds, 1e-9),
        "best_step": state.best_step,
        "history": state.history,
        "phase_seconds": state.phase_seconds,
        "bytes_pulled_per_sample": state.bytes_pulled / max(1, state.samples),
        "bytes_pushed_per_sample": state.bytes_pushed / max(1, state.samples),
        "rows_consumed": int(sum(r.size for r in state.row_ids)),
        "rows_consumed_unique": int(np.unique(np.concatenate(state.row_ids)).size) if state.row_ids else 0,
        "tables": runtime.table_stats(),
    }
    for split in ("validation", "test"):
        if split in sources:
            summary[split] = _metrics(*runtime.evaluate(split))
    return summary


def _absorb(state: TrainState, results: list[ChunkResult], running: BinaryMetricAccumulator) -> bool:
    state.step += results[0].steps
    for result in results:
        state.samples += result.samples
        state.bytes_pulled += result.bytes_pulled
        state.bytes_pushed += result.bytes_pushed
        if result.samples:
            running.update(result.labels, result.scores)
        state.row_ids.append(result.row_ids)
        for phase, seconds in result.phase_seconds.items():
            state.phase_seconds[phase] = state.phase_seconds.get(phase, 0.0) + seconds / len(results)
    return all(result.exhausted for result in results)


def _metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return {"auc": auc(labels, scores), "logloss": logloss(labels, scores), "rows": int(labels.size)}


def _evaluate_and_decide(
    config: RunConfig, runtime: Runtime, state: TrainState, writer: Any, epoch: int
) -> bool:
    """Evaluate on validation; track the best model; decay learning rates or stop on a plateau."""
    metrics = _metrics(*runtime.evaluate("validation"))
    metrics.update(step=state.step, epoch=epoch)
    state.history.append(metrics)
    _scalars(writer, "validation", metrics, state.step)
    logger.info("step %d validation auc %.5f logloss %.5f", state.step, metrics["auc"], metrics["logloss"])
    early = config.training.early_stopping
    if early is None:
        return False
    value = metrics[early.metric]
    better = state.best_metric is None or (
        value > state.best_metric if early.metric == "auc" else value < state.best_metric
    )
    if better:
        state.best_metric, state.best_step, state.bad_evals = value, state.step, 0
        runtime.save_snapshot("best")
        return False
    state.bad_evals += 1
    if state.bad_evals >= early.patience:
        logger.info(
            "early stopping at step %d: best %s %.5f at step %d",
            state.step,
            early.metric,
            state.best_metric or 0,
            state.best_step,
        )
        return True
    runtime.scale_learning_rates(early.lr_decay)
    logger.info("no improvement: learning rates x %g", early.lr_decay)
    return False


def _summary_writer(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # pragma: no cover - tensorboard is a dependency
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, float | int) and key not in ("step", "epoch") and np.isfinite(value):
            writer.add_scalar(f"{prefix}/{key}", value, step)
