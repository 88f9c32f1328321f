"""The training driver: epochs of steps (or a stream, continuously) on a runtime, evaluation, early
stopping, checkpoints, recovery.

`train(config)` is what `psrec train CONFIG` runs. It prepares the data (`psrec.train.data_sources`:
generating the synthetic Criteo-shaped set when the config asks for it), starts the runtime
(in-process or Ray) and drives it: every trainer runs `log_every_steps` steps at a time; between
chunks, at step boundaries, the driver reports progress (callback + TensorBoard,
`psrec.train.reporting`), evicts table rows as `embedding.*.eviction` says, evaluates on the
validation split (the end of every `eval_every_epochs`-th epoch and of the last, and every
`eval_every_steps`), keeps the best model under early
stopping (decaying every learning rate on a plateau; the rule is
`psrec.train.evaluation.decide_early_stopping`), and writes checkpoints (`psrec.train.checkpointing`;
every `checkpoint.every_steps` / `every_seconds`).

Continuous mode (`training.mode: continuous`, docs/streaming.md): no epochs; a chunk also ends when a
trainer's stream was quiet for `training.stream.wait_seconds`, the progress reports the lag and
progressive validation (`psrec.train.stream_progress`), and the run ends on `stop` (SIGTERM in
`psrec train`), `max_steps` or `stop_after_idle_s`, with a checkpoint of its last step.

Resume and failures: `train(..., resume=True)` restores the newest valid checkpoint chain of the
run directory. When a Ray actor dies (trainer or shard), the runtime replaces it and the whole job
rolls back to the last committed checkpoint (at most `fault_tolerance.max_restarts` times; the rule
is `psrec.checkpoint.policy.choose_restart`); the rows consumed after it are consumed again, and the
run's data accounting (`rows_consumed`) only counts rows of committed steps, so every training row
is counted exactly once. Finally the best (or last) model is evaluated on validation and test and
`RUN_DIR/summary.json` is written.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrec import storage
from psrec.config import RunConfig
from psrec.elastic.resharding import ScaleController
from psrec.machine import precisions_differ, summarize_trainers
from psrec.train.checkpointing import CheckpointSchedule, has_checkpoints, restart_decision
from psrec.train.data_sources import check_stored_sources, start_preparing_data
from psrec.train.evaluation import EarlyStoppingRecord, decide_early_stopping, evaluation_metrics
from psrec.train.reporting import summary_writer, write_scalars
from psrec.train.run_dir import apply_run_dir_plan, inspect_run_dir, plan_run_dir, upload_events, write_text
from psrec.train.runtime import make_runtime
from psrec.train.runtime_base import Runtime
from psrec.train.stream_progress import StreamProgress
from psrec.train.train_state import TrainState
from psrec.trainer.chunks import ChunkResult
from psrec.trainer.metrics import BinaryMetricAccumulator
from psrec.trainer.startup import paused_gc, startup_report

logger = logging.getLogger(__name__)


ProgressFn = Callable[[dict[str, Any]], None]


def train(
    config: RunConfig,
    *,
    base_dir: str | Path = ".",
    progress: ProgressFn | None = None,
    runtime: Runtime | None = None,
    resume: bool | None = None,
    started_at: float | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Train as `config` says; returns (and writes to RUN_DIR/summary.json) the run summary.

    `resume=None` (the default) resumes an interrupted run found in the run directory and moves a
    finished one aside to RUN_DIR-<time>; `True` always resumes from the newest valid checkpoint;
    `False` refuses a run directory that already holds checkpoints. psrec writes only into run
    directories it created (`psrec.train.run_dir`), and only once the data and runtime are set up.
    `started_at` (wall clock, `time.time()`) is when the program started, e.g. the `psrec` command's
    entry: the summary's ``startup.seconds_to_first_step`` counts from it, or from this call when None.
    `stop`: once set, the run ends at the next chunk's end with a checkpoint and its summary (how
    `psrec train` ends a continuous run on SIGTERM). A continuous run (``training.mode:
    continuous``) found in the run directory is always resumed: a stream run is never finished.
    """
    called_at = time.time()
    if resume is None and config.training.mode == "continuous":
        resume = True
    run_dir = storage.location(config.run_dir)
    plan = plan_run_dir(inspect_run_dir(run_dir, has_checkpoints=has_checkpoints(run_dir)), resume=resume)
    data = start_preparing_data(config, base_dir=Path(base_dir))  # rows not cached: on a thread
    sources = data.sources
    check_stored_sources(sources)
    started = time.perf_counter()
    owns_runtime = runtime is None
    if runtime is None:
        with paused_gc():  # an in-process trainer imports torch and builds its model (see paused_gc)
            runtime = make_runtime(config, base_dir=str(base_dir), data_sources=sources)
    try:
        data.wait()  # the trainers open the data once the driver starts the first epoch
        # the run's set-up succeeded: only now is the run directory touched
        apply_run_dir_plan(plan)
        write_text(
            run_dir / "config.json", json.dumps(config.model_dump(mode="json", by_alias=True), indent=2)
        )
    except BaseException:
        if owns_runtime:
            runtime.shutdown()
        raise
    # TensorBoard writes local files: for a run_dir in a store they go to a local temporary
    # directory, uploaded to RUN_DIR/tensorboard when the run ends.
    local_events = None if isinstance(run_dir, Path) else Path(tempfile.mkdtemp(prefix="psrec-events-"))
    writer = summary_writer(run_dir if isinstance(run_dir, Path) else Path(str(local_events)))
    try:
        driver = Driver(config, runtime, sources=sources, writer=writer, progress=progress, stop=stop)
        summary = driver.run(resume=plan.resume)
    finally:
        if writer is not None:
            writer.close()
        if owns_runtime:
            runtime.shutdown()
        if local_events is not None:
            upload_events(local_events, run_dir)
    summary["wall_seconds"] = time.perf_counter() - started
    summary["startup"] = startup_report(
        driver.first_step_at, train_called_at=called_at, started_at=started_at
    )
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2, default=float))
    return summary


class Driver:
    """Drives one run on a runtime (see the module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        runtime: Runtime,
        *,
        sources: dict[str, Any],
        writer: Any = None,
        progress: ProgressFn | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.stop = stop
        self.continuous = config.training.mode == "continuous"
        self.stream = StreamProgress(window=config.training.stream.metrics_window)
        self.runtime = runtime
        self.sources = sources
        self.writer = writer
        self.progress = progress
        self.run_dir = str(config.run_dir)
        self.state = TrainState()
        self.running = BinaryMetricAccumulator(window=100_000) if not self.continuous else self.stream.metrics
        self.train_seconds = 0.0  # of this process; so are the samples that go with them:
        self.timed_samples = 0  # state.samples also counts those trained before a resume
        self.phase_seconds: dict[str, float] = {}
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.checkpoints = CheckpointSchedule(config, runtime)
        self.positions: list[Any] = []  # each trainer's reader position after the last chunk
        self.first_step_at: float | None = None  # wall clock: the end of this process's first step
        self.recoveries: list[dict[str, Any]] = []
        self.best_snapshot = False
        self._epoch_steps: int | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.machines: dict[str, Any] = {}  # the trainers' machines and dense precision (_ask_machines)
        self.scaling = ScaleController(self.run_dir, config, runtime)  # `psrec scale`, between steps
        self.eviction_every = config.eviction_period()  # steps between evictions (None: no table evicts)
        self.evicted: dict[str, int] = {}

    # -- the run -------------------------------------------------------------------------------
    def run(self, *, resume: bool) -> dict[str, Any]:
        self.scaling.begin()
        try:
            return self._run(resume=resume)
        finally:
            self.scaling.end()

    def _run(self, *, resume: bool) -> dict[str, Any]:
        self._ask_machines()
        if not (resume and self._restore_latest()):
            self.runtime.start_epoch(0)
            self._checkpoint()  # step 0: a failure before the first periodic checkpoint rolls back here
        restarts = 0
        while True:
            try:
                if self.continuous:
                    self._train_continuously()
                else:
                    self._train_until_done()
                return self._finish()
            except Exception as error:
                decision = restart_decision(
                    error,
                    self.runtime,
                    restarts=restarts,
                    max_restarts=self.config.fault_tolerance.max_restarts,
                )
                if not decision.recover:
                    raise  # e.g. a bug or bad data: replaying would fail the same way
                restarts += 1
                self._recover(error)

    def _train_until_done(self) -> None:
        training = self.config.training
        state = self.state
        while state.epoch < training.epochs and not state.stopped:
            if state.epoch_done:
                state.epoch += 1
                state.epoch_done = False
                if state.epoch >= training.epochs:
                    break
                self.runtime.start_epoch(state.epoch)
            exhausted = False
            while not exhausted:
                if self.scaling.poll(self.state.step):  # moved rows are in no delta: the next is full
                    self.checkpoints.next_full()
                chunk = self._chunk_size()
                if chunk <= 0:  # max_steps reached mid-epoch: a later resume with more steps goes on
                    self._checkpoint()
                    return
                exhausted = self._train_chunk(chunk)
                if self._due(self.config.training.eval_every_steps) and not exhausted:
                    state.stopped = self._evaluate_and_decide()
                    if state.stopped:
                        break
                if self.checkpoints.due(state.step) and not exhausted:
                    self._checkpoint()
            if (
                not state.stopped
                and "validation" in self.sources
                and self._evaluated_now() is None
                and self._epoch_evaluated(state.epoch)
            ):
                state.stopped = self._evaluate_and_decide()
            state.epoch_done = True
            self._checkpoint()

    def _train_continuously(self) -> None:
        """Train while the stream's events arrive (`training.mode: continuous`): chunks of up to
        `log_every_steps` steps, each ended early when a trainer's stream was quiet for
        `training.stream.wait_seconds`; between chunks, report the lag, evaluate, checkpoint (and so
        publish) as due. Ends on `stop`, at `max_steps`, or when the stream stayed quiet for
        `training.stream.stop_after_idle_s`, with a checkpoint of the last step."""
        state = self.state
        while not (self.stop is not None and self.stop.is_set()):
            if self.scaling.poll(state.step):  # moved rows are in no delta: the next is full
                self.checkpoints.next_full()
            chunk = self._chunk_size()
            if chunk <= 0:
                break
            before = state.step
            exhausted = self._train_chunk(chunk)
            if exhausted:
                logger.info("the stream brought nothing for training.stream.stop_after_idle_s: the run ends")
                break
            if (
                state.step > before
                and self._due(self.config.training.eval_every_steps)
                and "validation" in self.sources
            ):
                self._evaluate_and_decide()
            if self.checkpoints.due(state.step):
                self._checkpoint()
        last = self.checkpoints.last
        if last is None or last.step != state.step:
            self._checkpoint()

    def _chunk_size(self) -> int:
        training = self.config.training
        chunk = training.log_every_steps
        if training.max_steps is not None:
            chunk = min(chunk, training.max_steps - self.state.step)
        for every in (training.eval_every_steps, self.config.checkpoint.every_steps, self.eviction_every):
            if every is not None:
                chunk = min(chunk, every - self.state.step % every)
        return chunk

    def _total_steps(self) -> int | None:
        """Expected steps of the whole run (for the progress bar's ETA), when they can be known."""
        if self.continuous:
            return None
        if self._epoch_steps is None:
            self._epoch_steps = self.runtime.epoch_steps() or 0
        training = self.config.training
        total = self._epoch_steps * training.epochs if self._epoch_steps else None
        if training.max_steps is not None:
            total = min(total, training.max_steps) if total is not None else training.max_steps
        return total

    def samples_per_second(self) -> float:
        """Samples trained per second of training, by this process (a resumed run's earlier
        samples took time that `train_seconds` does not hold)."""
        return self.timed_samples / max(self.train_seconds, 1e-9)

    def _due(self, every: int | None) -> bool:
        return every is not None and self.state.step % every == 0

    def _train_chunk(self, max_steps: int) -> bool:
        start = time.perf_counter()
        results = self.runtime.train_steps(max_steps)
        self.train_seconds += time.perf_counter() - start
        self.timed_samples += sum(result.samples for result in results)
        self._absorb(results)
        if self.continuous:
            self._report_stream(results)
        elif results[0].steps:
            samples = sum(r.samples for r in results)
            report: dict[str, Any] = {
                "total_steps": self._total_steps(),
                "epoch": self.state.epoch,
                "step": self.state.step,
                "samples": self.state.samples,
                "loss": sum(r.loss_sum for r in results) / max(1, samples),
                "running_auc": self.running.compute()["auc"] if len(self.running) else float("nan"),
                "samples_per_second": self.samples_per_second(),
            }
            write_scalars(self.writer, "train", report, self.state.step)
            report["phase_seconds"] = dict(self.phase_seconds)  # cumulative, for profiles of a window
            if self.progress is not None:
                self.progress(report)
        return all(result.exhausted for result in results)

    def _report_stream(self, results: list[ChunkResult]) -> None:
        """After a chunk of a continuous run: lag and progressive validation, to the progress
        callback and TensorBoard (`StreamProgress`)."""
        samples = sum(r.samples for r in results)
        point = self.stream.after_chunk(
            [r.stream for r in results if r.stream is not None],
            step=self.state.step,
            samples=self.state.samples,
        )
        write_scalars(
            self.writer,
            "stream",
            {k: v for k, v in point.items() if k not in ("step", "time", "samples")},
            self.state.step,
        )
        if self.progress is not None:
            self.progress(
                point
                | {
                    "total_steps": None,
                    "epoch": self.state.epoch,
                    "loss": sum(r.loss_sum for r in results) / samples if samples else float("nan"),
                    "running_auc": point["progressive_auc"],
                    "samples_per_second": self.samples_per_second(),
                    "phase_seconds": dict(self.phase_seconds),
                }
            )

    def _evict_if_due(self) -> None:
        """At every multiple of the eviction period (chunks end there): the tables' TTL and size
        limits applied; the rows removed reach serving as the next delta's tombstones."""
        if self.eviction_every is not None and self._due(self.eviction_every) and self.state.step > 0:
            for table, count in self.runtime.evict(self.state.step).items():
                self.evicted[table] = self.evicted.get(table, 0) + count

    def _absorb(self, results: list[ChunkResult]) -> None:
        stepped = results[0].steps > 0
        self.state.add_chunk(results)
        if self.first_step_at is None:
            ended = [r.first_step_at for r in results if r.first_step_at is not None]
            self.first_step_at = max(ended) if ended else None  # every trainer has stepped
        for result in results:
            self.bytes_pulled += result.bytes_pulled
            self.bytes_pushed += result.bytes_pushed
            if result.samples:
                self.running.update(result.labels, result.scores)
            for phase, seconds in result.phase_seconds.items():
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds / len(results)
        self.positions = [r.state.get("position") if r.state else None for r in results]
        if stepped:
            self._evict_if_due()

    # -- evaluation and early stopping ------------------------------------------------------------
    def _epoch_evaluated(self, epoch: int) -> bool:
        """Whether the end of `epoch` (0-based) is validated: every `eval_every_epochs`-th and the last."""
        training = self.config.training
        return (epoch + 1) % training.eval_every_epochs == 0 or epoch + 1 >= training.epochs

    def _evaluated_now(self) -> dict[str, Any] | None:
        """The validation metrics of the model as it is, when it was evaluated at this step already."""
        history = self.state.history
        return history[-1] if history and history[-1]["step"] == self.state.step else None

    def _evaluate_and_decide(self) -> bool:
        """Evaluate on validation; track the best model; decay learning rates or stop on a plateau."""
        state = self.state
        metrics: dict[str, Any] = evaluation_metrics(self.runtime.evaluate("validation"))
        metrics.update(step=state.step, epoch=state.epoch)
        state.history.append(metrics)
        write_scalars(self.writer, "validation", metrics, state.step)
        shown = " ".join(f"{k} {v:.5f}" for k, v in metrics.items() if isinstance(v, float))
        logger.info("step %d validation %s", state.step, shown)
        early = self.config.training.early_stopping
        if early is None:
            return False
        decision = decide_early_stopping(
            EarlyStoppingRecord(state.best_metric, state.best_step, state.bad_evals, state.lr_factor),
            metrics[early.metric],
            step=state.step,
            metric=early.metric,
            patience=early.patience,
            lr_decay=early.lr_decay,
        )
        after = decision.record
        state.best_metric, state.best_step = after.best_metric, after.best_step
        state.bad_evals, state.lr_factor = after.bad_evals, after.lr_factor
        if decision.action == "improved":
            self.runtime.save_snapshot("best")
            self.best_snapshot = True
            return False
        if decision.action == "stop":
            logger.info(
                "early stopping at step %d: best %s %.5f at step %d",
                state.step,
                early.metric,
                state.best_metric,
                state.best_step,
            )
            return True
        self.runtime.scale_learning_rates(early.lr_decay)
        logger.info("no improvement: learning rates x %g", early.lr_decay)
        return False

    # -- checkpoints and recovery --------------------------------------------------------------
    def _checkpoint(self) -> None:
        """A checkpoint of this step, full or delta as `CheckpointSchedule` decides."""
        self.checkpoints.write(
            self.state.step,
            lambda: self.state.extra() | {"dense_precision": self.machines["dense_precision"]["resolved"]},
            pinned_step=self._best_step(),
        )

    def _best_step(self) -> int | None:
        """The best model's step under early stopping (its checkpoint is kept for the final evaluation)."""
        if self.config.training.early_stopping is None or self.state.best_step < 0:
            return None
        return self.state.best_step

    def _restore_latest(self) -> bool:
        chain = self.checkpoints.chain()
        if not chain:
            return False
        restored = self.runtime.restore(chain)
        self._after_restore(chain, restored)
        self.resumed_from = {"checkpoint": chain[-1].name, "step": self.state.step}
        logger.info("resumed from %s at step %d", chain[-1].name, self.state.step)
        return True

    def _after_restore(self, chain: list[Any], restored: dict[str, Any] | None) -> None:
        if restored is None:
            self.state.roll_back(0, {})
            self.runtime.start_epoch(0)
            self.checkpoints.restored(None)
            return
        self.state.roll_back(int(restored["step"]), restored["extra"])
        trained_in, now = restored["extra"].get("dense_precision"), self.machines["dense_precision"]
        if trained_in is not None and trained_in != now["resolved"]:
            logger.warning(
                "checkpoint %s was trained in %s; training goes on in %s (%s)",
                chain[-1].name,
                trained_in,
                now["resolved"],
                now["reason"],
            )
        self.checkpoints.restored(chain)
        self.best_snapshot = False  # in-memory snapshots do not survive a restart

    def _recover(self, error: BaseException) -> None:
        failed_at = self.state.step
        logger.warning("actor failure at step %d (%s): recovering", failed_at, type(error).__name__)
        start = time.perf_counter()
        chain = self.checkpoints.chain()
        restored = self.runtime.recover(chain)
        self._ask_machines()  # replaced trainers may run elsewhere
        self._after_restore(chain, restored)
        seconds = time.perf_counter() - start
        self.recoveries.append(
            {
                "failed_at_step": failed_at,
                "restored_step": self.state.step,
                "seconds": seconds,
                "at": time.time(),  # wall clock, to measure kill -> training again
            }
        )
        logger.warning("recovered in %.1f s: continuing from step %d", seconds, self.state.step)

    def _ask_machines(self) -> None:
        """Ask the trainers where they run and in what dense precision; log it (warn when they differ)."""
        reports = self.runtime.machine_reports()
        self.machines = summarize_trainers(reports)
        machine, precision = self.machines["machine"], self.machines["dense_precision"]
        logger.info(
            "dense model in %s (%s) on %s [%s]",
            precision["resolved"],
            precision["reason"],
            machine["cpu_model"],
            " ".join(machine["isa_features"]),
        )
        if precisions_differ(reports):
            logger.warning(
                "the trainers train in different dense precisions (%s): their machines differ "
                "(summary.json, trainer_machines); set training.dense_precision to fp32 or bf16 to make them agree",
                ", ".join(report["dense_precision"]["resolved"] for report in reports),
            )

    # -- the end -------------------------------------------------------------------------------
    def _restore_best_model(self) -> str:
        """Load the best model for the final evaluation; says where it came from.

        "memory" (the snapshot taken when it was evaluated), "checkpoint NAME" (after a restart the
        snapshot is gone, but its step's checkpoint was kept by retention), "last" (no early
        stopping: the final model is evaluated) or "lost" (no checkpoint at the best step, e.g. the
        best came from a mid-epoch evaluation between checkpoints: the last model is evaluated).
        """
        best_step = self._best_step()
        if best_step is None:
            return "last"
        if self.best_snapshot:
            self.runtime.restore_snapshot("best")
            return "memory"
        chain: list[Any] = []
        if self.config.checkpoint.enabled:
            chain = self.checkpoints.chain(at_step=best_step)
        if not chain:
            logger.warning(
                "the best model (step %d) was lost in a restart: evaluating the last one", best_step
            )
            return "lost"
        self.runtime.restore(chain)
        logger.info("the best model (step %d) restored from checkpoint %s", best_step, chain[-1].name)
        return f"checkpoint {chain[-1].name}"

    def _finish(self) -> dict[str, Any]:
        state = self.state
        best_model = self._restore_best_model()
        summary: dict[str, Any] = {
            "steps": state.step,
            "epochs": state.epoch + (1 if state.epoch_done else 0),
            "samples": state.samples,
            "train_seconds": self.train_seconds,
            "samples_per_second": self.samples_per_second(),
            "best_step": state.best_step,
            "best_model": best_model,
            "history": state.history,
            "phase_seconds": self.phase_seconds,
            "bytes_pulled_per_sample": self.bytes_pulled / max(1, state.samples),
            "bytes_pushed_per_sample": self.bytes_pushed / max(1, state.samples),
            "rows_consumed": state.rows_consumed(),
            "rows_consumed_unique": state.rows_consumed_unique(),
            "rows_skipped": state.rows_skipped,
            "input": {**state.input_counts, "failed_units": state.failed_units},
            "checkpoints": self.checkpoints.seconds,
            "recoveries": self.recoveries,
            "failovers": self.runtime.failovers(),
            "resharding": self.scaling.report(),
            "resumed_from": self.resumed_from,
            "tables": self.runtime.table_stats(),
            "rows_evicted": self.evicted,
            "placement": self.runtime.placement,
            **summarize_trainers(self.runtime.machine_reports()),
        }
        if self.continuous:
            summary["mode"] = "continuous"
            summary["stream"] = self.stream.summary(self.positions)
        last = self._evaluated_now()
        if best_model in ("last", "lost") and last is not None:  # the model evaluated: its metrics
            summary["validation"] = {k: v for k, v in last.items() if k not in ("step", "epoch")}
        for split in ("validation", "test"):
            if split in self.sources and split not in summary:
                summary[split] = evaluation_metrics(self.runtime.evaluate(split))
        return summary
