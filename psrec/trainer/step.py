"""One trainer's step: pull rows, forward, backward, push row gradients, allreduce and update the dense part.

`StepRunner` is plain PyTorch + a `BatchLookup` (no Ray): the in-process runtime drives it
directly and the Ray trainer actor wraps it. Phase times (plan, pull, forward, backward, push,
allreduce, optimizer) accumulate in `phase_seconds` for the profile breakdown.

Consistency (see `psrec.ps.shard`):

- **sync**: each trainer waits for its pushes to be acknowledged before the dense allreduce. The
  allreduce is a barrier, so when any trainer leaves it, every shard has received every trainer's
  push for the step and has applied it: the next pull sees the step's update. With row gradients
  scaled by 1/N and dense gradients averaged, N trainers with batch b equal one trainer with batch N*b.
  A single trainer does not wait for its pushes: each shard executes one caller's calls in
  submission order, so the next step's pull, submitted after the push, still sees it (exact).
- **async** with staleness k: pushes are not waited for; the rows of the next batch are pulled
  (prefetched) before the current step runs, and a trainer never has more than k steps of its own
  pushes unacknowledged. Rows a step uses may therefore miss at most the last k steps of the
  trainer's own updates (`tests/train/test_staleness.py`). Other trainers' pushes are not waited
  for: with several async trainers a row may also miss another trainer's updates of up to k + 1
  steps, and `staleness: 0` is then not sync (each push is applied as its own optimizer step).

Task parallelism (the step's stages overlap, none of it changes a result):

- **input + routing**: a planner thread reads the next batches and routes them (dedup, per-shard
  split) while the current step computes; it takes exactly the batches `run` will train on, so the
  reader's position stays exact for checkpoints;
- **next batch's cold rows**: once a step's rows are pulled and the next batch is already routed
  (and its pull not yet sent), its ids in the tables with a disk tier go to the shards, in this
  process or behind Ray actors (`EmbeddingClient.prefetch`), whose disk tiers read its cold rows on
  a background thread during the step;
- **next pull**: the next batch's pull is submitted as early as exactness allows: right after this
  step's push with one trainer (per-caller order puts it behind the push) and in async mode, right
  after the dense allreduce with N sync trainers (the allreduce proves every push of the step was
  applied). The shards then apply the push and gather the next rows while the trainer runs the
  allreduce / dense optimizer step.

Phase times are those of the trainer's critical path ("plan" = waiting for a routed batch, "pull" =
submitting + waiting for rows); work moved off it is reported as ``plan_overlapped``.

Device: the dense model lives on the lookup's device (`BatchLookup.device`, ``training.device``);
labels follow the model input there, and scores come back to host memory. On a GPU the kernels run
asynchronously, so "forward" and "backward" time the host's part; the copy of the row gradients in
"push" waits for the GPU to finish the backward.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from psrec.data.background import BackgroundIterator, InputGate
from psrec.data.batch import Batch
from psrec.parallel.allreduce import allreduce_mean_
from psrec.ps.client import Pending, PulledRows, PullRequest
from psrec.trainer.dense_optimizer import DenseOptimizer
from psrec.trainer.device import numpy_of, to_device
from psrec.trainer.lookup import BatchLookup, LookupPlan


@dataclass
class StepResult:
    step: int
    loss: float
    scores: np.ndarray
    labels: np.ndarray
    row_ids: np.ndarray | None


OVERLAPPED = "_overlapped"  # suffix of phases that ran off the trainer's critical path


@dataclass
class _Prefetched:
    batch: Batch
    plan: LookupPlan
    request: PullRequest
    position: Any = None


class _Planner:
    """Reads and routes batches on a thread, two ahead of the consumer, across `run` calls.

    Each item carries the reader's position right after its batch (`position()`, called on the
    thread), so the runner knows the position of the last batch it trained on however far the
    planner read ahead. Exceptions of the reader (bad rows, I/O) are re-raised in the consumer,
    with their own type. `close` stops the thread and waits for it, so the reader is never used by
    two threads at once. With a gate, `next` is called by the trainer holding it; when no batch is
    ready, the trainer gives its hold up while it waits, so the input threads run then. `peek`
    shows the next item when it is ready, without waiting and without taking it.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        client: BatchLookup,
        timer: PhaseTimer,
        position: Callable[[], Any] | None,
        gate: InputGate | None = None,
    ) -> None:
        self.source = batches
        self._gate = gate

        def plans() -> Iterator[tuple[Batch, LookupPlan, Any]]:
            while True:
                start = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    return
                after = position() if position is not None else None
                plan = client.plan(batch)
                timer.add("plan" + OVERLAPPED, start)
                yield batch, plan, after

        self._plans = BackgroundIterator(plans, depth=2, name="psrec-planner", gate=gate)
        self._peeked: tuple[Batch, LookupPlan, Any] | None = None
        self._peeked_end = False
        self._peeked_error: Exception | None = None
        self.finished = False  # `next` returned the end (a stream window's end: a new planner goes on)

    def peek(self) -> tuple[Batch, LookupPlan, Any] | None:
        """The item `next` returns next if it is ready now, else None (never waits); an error of
        the reader is kept for `next` to raise."""
        if (
            self._peeked is None
            and not self._peeked_end
            and self._peeked_error is None
            and self._plans.ready()
        ):
            try:
                self._peeked = next(self._plans, None)
            except Exception as error:  # noqa: BLE001 - raised by `next`, when its batch is due
                self._peeked_error = error
            self._peeked_end = self._peeked is None and self._peeked_error is None
        return self._peeked

    def next(self) -> tuple[Batch, LookupPlan, Any] | None:
        """The next routed batch and the reader position after it, or None once the reader ran out."""
        if self._peeked is not None:
            peeked, self._peeked = self._peeked, None
            return peeked
        if self._peeked_error is not None:
            error, self._peeked_error = self._peeked_error, None
            raise error
        if self._peeked_end:
            self.finished = True
            return None
        item: tuple[Batch, LookupPlan, Any] | None
        if self._gate is not None and not self._plans.ready():
            with self._gate.released():
                item = next(self._plans, None)
        else:
            item = next(self._plans, None)
        self.finished = item is None
        return item

    def close(self) -> None:
        self._plans.close()


@dataclass
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def add(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - start
        return now


class StepRunner:
    """Runs training steps for one trainer (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | DenseOptimizer,
        client: BatchLookup,
        *,
        world_size: int = 1,
        mode: str = "sync",
        staleness: int = 1,
        grad_clip_norm: float | None = None,
        bf16: bool = False,
        input_gate: InputGate | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.world_size = world_size
        self.mode = mode
        self.staleness = staleness if mode == "async" else 0
        self.grad_clip_norm = grad_clip_norm
        self.bf16 = bf16  # autocast the dense model; pulled rows and their gradients stay fp32
        # ... gathered for the model in bf16 when it declares it consumes them in bf16 anyway
        accepts = bf16 and getattr(model, "accepts_bf16_rows", False)
        self.pooled_dtype = torch.bfloat16 if accepts else torch.float32
        self.device = client.device  # None: the CPU, over the pulled buffers themselves
        self._autocast = "cpu" if self.device is None else self.device.type
        self.timer = PhaseTimer()
        self._unacknowledged: collections.deque[list[Pending]] = collections.deque()
        self._planner: _Planner | None = None
        # Held for the whole of `run`, given up only while it waits for a batch (psrec.data.background).
        self.input_gate = input_gate
        # Reader position after the last batch trained on (None: none yet from this reader).
        self.trained_position: Any = None

    def _submit(self, planner: _Planner, ahead: collections.deque[_Prefetched], step: int) -> bool:
        """Route the next batch (already done by the planner) and submit its pull for `step`; False
        at the end. The pull is numbered `step + 1` (a repeat of the step sends the same number)."""
        start = time.perf_counter()
        item = planner.next()
        start = self.timer.add("plan", start)
        if item is None:
            return False
        batch, plan, position = item
        request = self.client.submit_pull(plan, train=True, request=step + 1)
        ahead.append(_Prefetched(batch, plan, request, position))
        self.timer.add("pull", start)
        return True

    def _prefetch_next(self, planner: _Planner) -> None:
        """Tell the shards the next batch's ids when it is already routed, so a disk tier reads its
        cold rows while this step computes (`EmbeddingClient.prefetch`; no result changes)."""
        item = planner.peek()
        if item is not None:
            self.client.prefetch(item[1])

    def _holding_input(self) -> contextlib.AbstractContextManager[None]:
        return self.input_gate.held() if self.input_gate is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the planner (before its reader is closed or replaced); forget the trained position."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        self.trained_position = None

    def run(
        self,
        batches: Iterator[Batch],
        *,
        first_step: int,
        max_steps: int,
        position: Callable[[], Any] | None = None,
    ) -> Iterator[StepResult]:
        """Train on up to `max_steps` batches from `batches`; yields one result per step.

        The planner keeps reading ahead between calls with the same `batches` (its read-ahead is
        not lost at a chunk's end); `position` gives the reader's position, recorded per batch in
        `trained_position`. An error closes the planner, so a retry starts from the reader afresh;
        `trained_position` still says where the last step that completed left the reader.
        """
        self.model.train()
        ahead: collections.deque[_Prefetched] = collections.deque()
        if self._planner is None or self._planner.source is not batches or self._planner.finished:
            self.close()
            self._planner = _Planner(batches, self.client, self.timer, position, self.input_gate)
        planner = self._planner
        taken = 0
        exhausted = False
        failure: BaseException | None = None  # a reader error, raised when its batch is due

        def submit_next() -> None:
            nonlocal exhausted, failure, taken
            # Async: `staleness` batches' pulls in flight ahead of the step being computed; sync: one.
            # Never beyond this call's `max_steps`: a pull submitted early grows tables.
            try:
                while not exhausted and len(ahead) <= self.staleness and taken < max_steps:
                    exhausted = not self._submit(planner, ahead, first_step + taken)
                    taken += not exhausted
            except Exception as error:  # noqa: BLE001 - the current step completes first
                exhausted, failure = True, error

        step = first_step
        try:
            # Held for the whole loop: the input threads run only while this waits for a batch
            # (`_Planner.next`), never beside the step's own work (psrec.data.background).
            with self._holding_input():
                while step < first_step + max_steps:
                    submit_next()
                    if failure is not None and not ahead:
                        raise failure
                    if self.world_size > 1:
                        # Trainers' shares may differ by a batch: all keep stepping until every one is out
                        # of data; one that is out runs empty steps so sync shards and the allreduce complete.
                        if not _any_across_trainers(bool(ahead)):
                            break
                        if not ahead:
                            yield self._empty_step(step)
                            step += 1
                            continue
                    elif not ahead:
                        break
                    current = ahead.popleft()
                    start = time.perf_counter()
                    pulled = self.client.collect_pull(current.plan, current.request)
                    if not ahead:
                        self._prefetch_next(planner)
                    self.timer.add("pull", start)
                    result = self._train(current.batch, current.plan, pulled, step, submit_next)
                    self.trained_position = current.position
                    yield result
                    step += 1
        except BaseException:
            trained = self.trained_position
            self.close()
            self.trained_position = trained
            raise
        self.flush()

    def _train(
        self,
        batch: Batch,
        plan: LookupPlan,
        pulled: PulledRows,
        step: int,
        submit_next: Callable[[], None],
    ) -> StepResult:
        timer = self.timer
        start = time.perf_counter()
        inp, weights = self.client.embed(plan, pulled, batch.dense, pooled_dtype=self.pooled_dtype)
        labels = (
            torch.from_numpy(np.require(batch.labels, requirements="W"))
            if self.device is None
            else to_device(batch.labels, self.device)
        )
        with torch.autocast(self._autocast, dtype=torch.bfloat16, enabled=self.bf16):
            loss, scores = self.model.loss(inp, labels)  # type: ignore[operator]
        loss, scores = loss.float(), scores.float()
        start = timer.add("forward", start)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        start = timer.add("backward", start)
        barrier = self.mode == "sync" and self.world_size > 1
        handles = self.client.submit_push(plan, weights, step=step, scale=1.0 / self.world_size)
        if barrier:
            for handle in handles:  # the allreduce below is the barrier that makes the step complete
                handle.result()
        else:
            # Async, or sync with one trainer: a shard runs one caller's calls in submission order,
            # so the next pull (submitted now, after this push) sees this push without waiting.
            self._unacknowledged.append(handles)
            while len(self._unacknowledged) > max(1, self.staleness):
                for handle in self._unacknowledged.popleft():
                    handle.result()
        start = timer.add("push", start)
        if not barrier:
            submit_next()  # records its own plan / pull time
            start = time.perf_counter()
        allreduce_mean_(self._dense_grads() + self._running_statistics(), self.world_size)
        start = timer.add("allreduce", start)
        if barrier:
            submit_next()  # every trainer's push of this step is applied: the next pull is exact
            start = time.perf_counter()
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        timer.add("optimizer", start)
        return StepResult(step, float(loss.detach()), numpy_of(scores), batch.labels, batch.row_ids)

    def _empty_step(self, step: int) -> StepResult:
        for handle in self.client.submit_empty_push(step=step):
            handle.result()
        grads = self._dense_grads()
        for grad in grads:
            grad.zero_()
        allreduce_mean_(grads + self._running_statistics(), self.world_size)
        self.optimizer.step()
        empty = np.zeros(0, dtype=np.float32)
        return StepResult(step, float("nan"), empty, empty, np.zeros(0, dtype=np.int64))

    def _dense_grads(self) -> list[torch.Tensor]:
        """Every dense parameter's gradient, zeros where backward gave none, so that all trainers
        allreduce the same tensors and step the same parameters (their replicas stay identical)."""
        grads = []
        for parameter in self.model.parameters():
            if parameter.requires_grad:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                grads.append(parameter.grad)
        return grads

    def _running_statistics(self) -> list[torch.Tensor]:
        """The model's floating-point buffers (batch-norm running mean / variance), averaged with the
        gradients: each trainer's forward updates them from its own batch only, and without the
        average the replicas would evaluate with different statistics (DDP broadcasts rank 0's)."""
        return [buffer for buffer in self.model.buffers() if buffer.is_floating_point()]

    def flush(self) -> None:
        """Wait for every outstanding push (async mode), e.g. before evaluation or a checkpoint."""
        while self._unacknowledged:
            for handle in self._unacknowledged.popleft():
                handle.result()

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        self.model.eval()
        plan = self.client.plan(batch)
        pulled = self.client.pull(plan, train=False)
        inp, _ = self.client.embed(
            plan, pulled, batch.dense, requires_grad=False, pooled_dtype=self.pooled_dtype
        )
        with torch.autocast(self._autocast, dtype=torch.bfloat16, enabled=self.bf16):
            scores = self.model.predict(inp)  # type: ignore[operator]
        self.model.train()
        return numpy_of(scores.float())


def _any_across_trainers(flag: bool) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
