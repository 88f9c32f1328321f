"""One trainer's step: pull rows, forward, backward, push row gradients, allreduce and update the dense part.

`StepRunner` is plain PyTorch + an `EmbeddingClient` (no Ray): the in-process runtime drives it
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
  pushes unacknowledged. Rows a step uses may therefore miss at most the last k steps' updates.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from psrec.data.batch import Batch
from psrec.ps.client import EmbeddingClient, LookupPlan, Pending, PulledRows, linear_table_name


@dataclass
class StepResult:
    step: int
    loss: float
    scores: np.ndarray
    labels: np.ndarray
    row_ids: np.ndarray | None


@dataclass
class _Prefetched:
    batch: Batch
    plan: LookupPlan
    handles: list[Pending]


@dataclass
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def add(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - start
        return now


def allreduce_mean_(tensors: list[torch.Tensor], world_size: int) -> None:
    """Average tensors across the process group in one flat allreduce."""
    if world_size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class StepRunner:
    """Runs training steps for one trainer (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        client: EmbeddingClient,
        *,
        world_size: int = 1,
        mode: str = "sync",
        staleness: int = 1,
        embedding_l2: float = 0.0,
        grad_clip_norm: float | None = None,
        bf16: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.world_size = world_size
        self.mode = mode
        self.staleness = staleness if mode == "async" else 0
        self.embedding_l2 = embedding_l2
        self.grad_clip_norm = grad_clip_norm
        self.bf16 = bf16  # autocast the dense model; pulled rows and their gradients stay fp32
        self.timer = PhaseTimer()
        self._unacknowledged: collections.deque[list[Pending]] = collections.deque()

    def _prefetch(self, batch: Batch) -> _Prefetched:
        start = time.perf_counter()
        plan = self.client.plan(batch)
        start = self.timer.add("plan", start)
        handles = self.client.submit_pull(plan, train=True)
        self.timer.add("pull", start)
        return _Prefetched(batch, plan, handles)

    def run(self, batches: Iterator[Batch], *, first_step: int, max_steps: int) -> Iterator[StepResult]:
        """Train on up to `max_steps` batches from `batches`; yields one result per step."""
        self.model.train()
        ahead: collections.deque[_Prefetched] = collections.deque()
        step = first_step
        exhausted = False
        while step < first_step + max_steps:
            # Async: keep `staleness` batches' pulls in flight ahead of the step being computed.
            while (
                not exhausted and len(ahead) <= self.staleness and len(ahead) + step - first_step < max_steps
            ):
                batch = next(batches, None)
                if batch is None:
                    exhausted = True
                    break
                ahead.append(self._prefetch(batch))
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
            pulled = self.client.collect_pull(current.plan, current.handles)
            self.timer.add("pull", start)
            yield self._train(current.batch, pulled, step)
            step += 1
        self.flush()

    def _train(self, batch: Batch, pulled: PulledRows, step: int) -> StepResult:
        timer = self.timer
        start = time.perf_counter()
        inp, weights = self.client.embed(pulled, batch.dense)
        labels = torch.from_numpy(np.require(batch.labels, requirements="W"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss, scores = self.model.loss(inp, labels)  # type: ignore[operator]
        loss, scores = loss.float(), scores.float()
        total = loss
        if self.embedding_l2 > 0:
            reg = sum((w * w).sum() for name, w in weights.items() if not _is_linear(name))
            total = loss + 0.5 * self.embedding_l2 * reg
        start = timer.add("forward", start)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        start = timer.add("backward", start)
        handles = self.client.submit_push(pulled.plan, weights, step=step, scale=1.0 / self.world_size)
        if self.mode == "sync" and self.world_size > 1:
            for handle in handles:  # the allreduce below is the barrier that makes the step complete
                handle.result()
        else:
            # Async, or sync with one trainer: a shard runs one caller's calls in submission order,
            # so the next pull (submitted after this push) sees this push without waiting for it.
            self._unacknowledged.append(handles)
            while len(self._unacknowledged) > max(1, self.staleness):
                for handle in self._unacknowledged.popleft():
                    handle.result()
        start = timer.add("push", start)
        allreduce_mean_(self._dense_grads(), self.world_size)
        start = timer.add("allreduce", start)
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        timer.add("optimizer", start)
        return StepResult(step, float(loss.detach()), scores.numpy(), batch.labels, batch.row_ids)

    def _empty_step(self, step: int) -> StepResult:
        for handle in self.client.submit_empty_push(step=step):
            handle.result()
        grads = self._dense_grads()
        for grad in grads:
            grad.zero_()
        allreduce_mean_(grads, self.world_size)
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

    def flush(self) -> None:
        """Wait for every outstanding push (async mode), e.g. before evaluation or a checkpoint."""
        while self._unacknowledged:
            for handle in self._unacknowledged.popleft():
                handle.result()

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        self.model.eval()
        pulled = self.client.pull(self.client.plan(batch), train=False)
        inp, _ = self.client.embed(pulled, batch.dense, requires_grad=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            scores = self.model.predict(inp)  # type: ignore[operator]
        self.model.train()
        return scores.float().numpy()


def _any_across_trainers(flag: bool) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _is_linear(table: str) -> bool:
    return table.endswith(linear_table_name(""))
