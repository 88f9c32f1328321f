"""The training step of `psrec train` with ``ps.pipeline``: the dense model split into pipeline stages.

W = ``ps.num_trainers`` trainers form R = W / S replicas of S stages (`PipelineLayout`: trainer r is
stage r % S of replica r // S). Every trainer builds the full model (same seed, identical init) and
a `PipelineStepper` that runs its stage; the replicas train data-parallel. Only the first stage of a
replica reads data (the replica's share: shard r // S of R) and talks to the PS. One step:

1. **header**: every trainer all-gathers ``[has batch, batch size, target shape]``; the step loop
   ends when no replica has a batch (all trainers together, as in `StepRunner`);
2. the first stage pulls the rows, builds the `ModelInput` from leaf row tensors (`BatchLookup.embed`)
   and sends the last stage the target: the real-position mask (SASRec) or the labels (BST);
3. the stepper streams the micro-batches through the stages and averages each stage's gradients
   over the replicas; a replica without a batch while others have one joins with zero gradients
   (`skip_step`) and its first stage sends the shards an empty push (`StepRunner`'s rule);
4. the first stage pushes the leaf tensors' gradients scaled by 1/R, as `StepRunner` does; the last
   stage sends it back the loss and the scores for the running metrics;
5. every trainer clips (norm over the whole replica) and steps the dense optimizer: parameters of
   other stages have no gradient, so the optimizer leaves them unchanged.

Shards count one push per replica and step (`builders.pushing_trainers`: the shard is told R, not W),
so the other stages never talk to the tables during training. The next pull is submitted right after
the push with one replica (a shard runs one caller's calls in order) and after the next step's header
with several (the header all-gather proves every replica's push was acknowledged, hence applied).

When a `run` ends, `synchronize` broadcasts every stage's parameters, buffers and optimizer state
from the trainer of replica 0 that trains it, so every trainer holds the current full model: the
unchanged evaluation (each trainer scores its share with the full model), snapshots and checkpoints
(dense state and optimizer from trainer 0) work as without the pipeline. The cost: every trainer
keeps the whole dense model and its optimizer state in memory; the pipeline splits the activations
and the compute, not the parameters.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from psrec.data.batch import Batch
from psrec.models.base import ModelInput
from psrec.parallel.pipeline import PipelineLayout, PipelineStepper
from psrec.ps.client import Pending, PullRequest
from psrec.trainer.dense_optimizer import DenseOptimizer
from psrec.trainer.lookup import BatchLookup, LookupPlan
from psrec.trainer.step import PhaseTimer, StepResult

HEADER = 4  # [has batch, batch size, target ndim, sequence length (ranking targets) or 0]


@dataclass
class _Ahead:
    batch: Batch
    plan: LookupPlan
    request: PullRequest | None = None  # None until the pull is submitted


class PipelineStepRunner:
    """The `Runner` interface (`psrec.trainer.runner`) over a pipeline stage.

    It does not read ahead across `run` calls: `close` has nothing to stop and `trained_position`
    is None (the reader's own position is the trained one).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | DenseOptimizer,
        client: BatchLookup,
        *,
        rank: int,
        layout: PipelineLayout,
        n_microbatches: int,
        schedule: str,
        grad_clip_norm: float | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.client = client
        self.rank = rank
        self.layout = layout
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.grad_clip_norm = grad_clip_norm
        replica_ranks = layout.pipeline_ranks(layout.replica_of(rank))
        self.first_rank, self.last_rank = replica_ranks[0], replica_ranks[-1]
        self.is_first = rank == self.first_rank
        self.is_last = rank == self.last_rank
        self.timer = PhaseTimer()
        self._stepper: PipelineStepper | None = None
        self._unacknowledged: collections.deque[list[Pending]] = collections.deque()

    @property
    def stepper(self) -> PipelineStepper:
        """Built at first use, by every trainer together (it creates the process subgroups)."""
        if self._stepper is None:
            self._stepper = PipelineStepper(
                self.model, self.layout, n_microbatches=self.n_microbatches, schedule=self.schedule
            )
        return self._stepper

    # -- the step loop ---------------------------------------------------------------------------
    @property
    def trained_position(self) -> None:
        """Always None: nothing is read ahead, so the reader's position is that of the last batch trained."""
        return None

    def close(self) -> None:
        """Nothing to stop: batches are read on the training thread, never ahead of `run`."""

    def run(
        self,
        batches: Iterator[Batch],
        *,
        first_step: int,
        max_steps: int,
        position: Callable[[], Any] | None = None,
    ) -> Iterator[StepResult]:
        """Train up to `max_steps` steps; only the first stage reads `batches`. Yields one result per step.

        `position` is not used (see `trained_position`).
        """
        self.model.train()
        assert self.stepper is not None  # built here, by every trainer at the same point
        ahead: _Ahead | None = None
        exhausted = not self.is_first
        end = first_step + max_steps
        step = first_step
        while step < end:
            if ahead is None and not exhausted:
                ahead = self._read(batches)
                exhausted = ahead is None
            start = time.perf_counter()
            headers = self._exchange_headers(ahead)
            self.timer.add("exchange", start)
            if not headers[:, 0].any():
                break
            header = headers[self.first_rank]
            if not header[0]:
                yield self._skip_step(step)
            elif self.is_first:
                assert ahead is not None
                # One replica: the next batch is read and pulled inside the step, right after the push.
                prefetch = self.layout.num_replicas == 1 and step + 1 < end
                result, ahead = self._first_stage_step(ahead, step, batches, prefetch=prefetch)
                exhausted = exhausted or (prefetch and ahead is None)
                yield result
            else:
                yield self._later_stage_step(header, step)
            step += 1
        self.flush()
        self.synchronize()

    def _read(self, batches: Iterator[Batch]) -> _Ahead | None:
        start = time.perf_counter()
        batch = next(batches, None)
        ahead = None if batch is None else _Ahead(batch, self.client.plan(batch))
        self.timer.add("plan", start)
        return ahead

    def _submit_pull(self, ahead: _Ahead) -> None:
        start = time.perf_counter()
        ahead.request = self.client.submit_pull(ahead.plan, train=True)
        self.timer.add("pull", start)

    def _exchange_headers(self, ahead: _Ahead | None) -> torch.Tensor:
        """(W, HEADER): every trainer's header; only first stages' are nonzero."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        if ahead is not None:
            batch = ahead.batch
            sequence = batch.sequences.get("pos")
            header[0], header[1] = 1, batch.batch_size
            if sequence is not None:  # ranking (SASRec): the target is the (B, L) real-position mask
                header[2], header[3] = 2, sequence.mask.shape[1]
            else:
                header[2] = 1
        gathered = [torch.zeros_like(header) for _ in range(self.layout.world_size)]
        dist.all_gather(gathered, header)
        return torch.stack(gathered)

    def _first_stage_step(
        self, current: _Ahead, step: int, batches: Iterator[Batch], *, prefetch: bool
    ) -> tuple[StepResult, _Ahead | None]:
        timer = self.timer
        if current.request is None:  # several replicas: submitted only now, after the header barrier
            self._submit_pull(current)
        assert current.request is not None
        start = time.perf_counter()
        pulled = self.client.collect_pull(current.plan, current.request)
        start = timer.add("pull", start)
        inp, weights = self.client.embed(current.plan, pulled, current.batch.dense)
        target = _target(inp, current.batch)
        dist.send(target, dst=self.last_rank)
        start = timer.add("exchange", start)
        self.stepper.step(inp, None)
        start = timer.add("forward_backward", start)
        handles = self.client.submit_push(
            current.plan, weights, step=step, scale=1.0 / self.layout.num_replicas
        )
        ahead = None
        if self.layout.num_replicas == 1:
            # A shard runs one caller's calls in order: the next pull, submitted now, sees this push.
            self._unacknowledged.append(handles)
            while len(self._unacknowledged) > 1:
                for handle in self._unacknowledged.popleft():
                    handle.result()
            timer.add("push", start)
            if prefetch:
                ahead = self._read(batches)
                if ahead is not None:
                    self._submit_pull(ahead)
        else:
            for handle in handles:  # the next step's header all-gather is the barrier
                handle.result()
            timer.add("push", start)
        start = time.perf_counter()
        batch_size = current.batch.batch_size
        width = 2 if target.ndim == 2 else 1
        reply = torch.empty(1 + batch_size * width, dtype=torch.float64)
        dist.recv(reply, src=self.last_rank)
        start = timer.add("exchange", start)
        self._update()
        timer.add("optimizer", start)
        scores = (
            reply[1:].float().numpy().reshape(batch_size, width) if width == 2 else reply[1:].float().numpy()
        )
        batch = current.batch
        return StepResult(step, float(reply[0]), scores, batch.labels, batch.row_ids), ahead

    def _later_stage_step(self, header: torch.Tensor, step: int) -> StepResult:
        timer = self.timer
        start = time.perf_counter()
        batch_size, ndim, length = int(header[1]), int(header[2]), int(header[3])
        target = None
        if self.is_last:
            target = torch.empty((batch_size, length) if ndim == 2 else (batch_size,))
            dist.recv(target, src=self.first_rank)
            start = timer.add("exchange", start)
        loss = self.stepper.step(None, target, batch_size=batch_size)
        start = timer.add("forward_backward", start)
        if self.is_last:
            assert loss is not None
            reply = torch.cat([torch.tensor([loss], dtype=torch.float64), _scores(self.stepper.last_output)])
            dist.send(reply, dst=self.first_rank)
            start = timer.add("exchange", start)
        self._update()
        timer.add("optimizer", start)
        return _empty_result(step)

    def _skip_step(self, step: int) -> StepResult:
        """This replica is out of data while another is not: zero gradients, an empty push."""
        if self.is_first:
            for handle in self.client.submit_empty_push(step=step):
                handle.result()
        self.stepper.skip_step()
        self._update()
        return _empty_result(step)

    def _update(self) -> None:
        """Clip by the replica's whole gradient norm (all stages) and step the dense optimizer."""
        if self.grad_clip_norm is not None:
            grads = [p.grad for p in self.stepper.stage_parameters() if p.grad is not None]
            squared = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
            squared = squared.reshape(1).double()
            dist.all_reduce(squared, group=self.stepper.pipeline_group)
            coefficient = min(1.0, self.grad_clip_norm / (float(squared.sqrt()) + 1e-6))
            for grad in grads:
                grad.mul_(coefficient)
        self.optimizer.step()

    # -- after a run ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every outstanding push, e.g. before evaluation or a checkpoint."""
        while self._unacknowledged:
            for handle in self._unacknowledged.popleft():
                handle.result()

    def synchronize(self) -> None:
        """Give every trainer the current full model: each stage's parameters, buffers and optimizer
        state are broadcast from the trainer of replica 0 that trains that stage (every trainer calls it)."""
        owners = self.layout.pipeline_ranks(0)
        for stage, owner in enumerate(owners):
            parameters = self.stepper.stage_parameters(stage)
            tensors = [*parameters, *self.stepper.stage_buffers(stage)]
            if tensors:
                flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
                dist.broadcast(flat, src=owner)
                offset = 0
                with torch.no_grad():
                    for tensor in tensors:
                        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                        offset += tensor.numel()
            state: list[Any] = [[self.optimizer.state.get(p, {}) for p in parameters]]
            dist.broadcast_object_list(state, src=owner)
            if self.rank != owner:
                for parameter, value in zip(parameters, state[0], strict=True):
                    if value:
                        self.optimizer.state[parameter] = value

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Scores of the full (synchronized) model, as `StepRunner.predict`."""
        self.model.eval()
        plan = self.client.plan(batch)
        pulled = self.client.pull(plan, train=False)
        inp, _ = self.client.embed(plan, pulled, batch.dense, requires_grad=False)
        scores = self.model.predict(inp)  # type: ignore[operator]
        self.model.train()
        return scores.float().numpy()


def _target(inp: ModelInput, batch: Batch) -> torch.Tensor:
    """What the last stage's loss needs: the (B, L) real-position mask (SASRec) or the (B,) labels."""
    if "pos" in inp.sequences:
        return inp.masks.get("pos", inp.masks["seq"]).float().contiguous()
    return torch.from_numpy(np.require(batch.labels, np.float32, requirements="W")).contiguous()


def _scores(output: Any) -> torch.Tensor:
    """The running metrics' scores, flat float64: SASRec's [positive, negative] logits at the last
    position (B, 2); BST's click probabilities (B,) (as `model.loss` returns them)."""
    if isinstance(output, tuple):
        positive, negative = output  # negative (B, L), or (B, L, N) for the sampled softmax
        last_negative = negative[:, -1] if negative.ndim == 2 else negative[:, -1, 0]
        scores = torch.stack([positive[:, -1], last_negative], dim=1)
    else:
        scores = torch.sigmoid(output)
    return scores.reshape(-1).double()


def _empty_result(step: int) -> StepResult:
    empty = np.zeros(0, dtype=np.float32)
    return StepResult(step, float("nan"), empty, empty, np.zeros(0, dtype=np.int64))
