"""Pipeline parallelism for the sequence recommenders (SASRec, BST, HSTU) with `torch.distributed.pipelining`.

A sequence model's `stages()` (embedding, block stack, head) become a chain of parts
``[embedding, block 0, ..., block n-1, head]`` (the stack's `block_parts()`) cut into `num_stages`
contiguous stages (`psrec.parallel.stage_planner.split_parts`): the embedding stage goes first, the head last, the blocks are
dealt out evenly. Each
process runs one stage as a `PipelineStage`; a `ScheduleGPipe` or `Schedule1F1B` schedule streams
micro-batches through them. With W = R * S processes, R pipeline replicas of S stages each train
data-parallel: rank r is stage ``r % S`` of replica ``r // S`` (`PipelineLayout`), and after each step
the dense gradients of a stage are averaged over the R ranks that hold it.

Between stages the model's state dict (``{"hidden", "mask", ...}``) travels as a tuple of tensors in
a fixed key order; bool masks travel as float (0/1) and are turned back into bool on arrival. The
first stage also learns the key orders from a dry run on one sample and broadcasts them to the other
stages on the first step.

Loss: the last stage computes the loss of each micro-batch normalised by the **whole** batch's count
(real positions for SASRec, samples for BST), and the schedule does not rescale gradients, so the
micro-batch losses sum to the unsplit model's mean loss and the gradients equal its gradients (up to
float summation order; `tests/parallel/test_pipeline.py` checks it). Dropout draws differ per
micro-batch, so with dropout the pipeline equals the unsplit model in distribution, not bitwise.

Batches may change size (an epoch's last batch): a stage's receive buffers have fixed shapes, so
each batch size gets its own `PipelineStage` and schedule, with as many micro-batches (up to the
configured count) as split the batch evenly (`microbatches_for`). A replica without a batch while
the others have one calls `skip_step`: zero gradients join the replica average.

Embeddings stay on the parameter server (or collective shards): the first stage pulls rows and
builds the `ModelInput` from leaf row tensors; after `step` their `.grad` holds the row gradients to
push, exactly as in the unsplit step. Only the first stage of each replica talks to the tables.

    stepper = PipelineStepper(model, layout, n_microbatches=4)
    loss = stepper.step(inp if stepper.is_first else None, target if stepper.is_last else None)
    optimizer.step()   # this rank's stage parameters: stepper.stage_module.parameters()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as functional
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from psrec.models.base import ModelInput
from psrec.models.sasrec import sampled_softmax_loss
from psrec.parallel.allreduce import allreduce_mean
from psrec.parallel.stage_planner import split_parts

logger = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# -- layout: pure ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineLayout:
    """W = num_replicas * num_stages ranks; rank r is stage r % S of replica r // S."""

    world_size: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of num_stages {self.num_stages}"
            )

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.num_stages

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica, stage 0 first (they exchange activations)."""
        return [replica * self.num_stages + stage for stage in range(self.num_stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage, one per replica (they average its dense gradients)."""
        return [replica * self.num_stages + stage for replica in range(self.num_replicas)]


# -- stage modules --------------------------------------------------------------------------------
def model_parts(model: nn.Module) -> list[nn.Module]:
    """``[embedding, block 0, ..., head]`` of a model with `stages()`; their chain equals the forward.

    The blocks are the stack's `block_parts()` (`psrec.models.base.BlockStack`): SASRec's and BST's
    Transformer blocks, HSTU's blocks (each packing its batch when jagged)."""
    stages = model.stages()  # type: ignore[operator]
    block_parts = getattr(stages.blocks, "block_parts", None)
    if block_parts is None:
        raise TypeError(
            f"pipeline needs a block stack with block_parts(), got {type(stages.blocks).__name__}"
        )
    return [stages.embedding, *block_parts(), stages.head]


def input_keys(inp: ModelInput) -> tuple[str, ...]:
    """Flat argument names of a `ModelInput` for the first stage (all tensors with the batch first)."""
    keys = ["dense", "pooled"] + (["linear"] if inp.linear is not None else [])
    for name in sorted(inp.sequences):
        keys.append(f"sequence:{name}")
        if name in inp.masks:
            keys.append(f"mask:{name}")
        if name in inp.timestamps:
            keys.append(f"timestamps:{name}")
        if name in inp.ids:
            keys.append(f"ids:{name}")
    return tuple(keys)


def flatten_input(inp: ModelInput, keys: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    out = []
    for key in keys:
        kind, _, name = key.partition(":")
        if kind == "sequence":
            out.append(inp.sequences[name])
        elif kind == "mask":
            out.append(inp.masks[name])
        elif kind == "timestamps":
            out.append(inp.timestamps[name])
        elif kind == "ids":
            out.append(inp.ids[name])
        else:
            out.append(getattr(inp, kind))
    return tuple(out)


def unflatten_input(keys: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> ModelInput:
    fields: dict[str, Any] = {"linear": None, "sequences": {}, "masks": {}, "timestamps": {}, "ids": {}}
    for key, tensor in zip(keys, tensors, strict=True):
        kind, _, name = key.partition(":")
        if kind == "sequence":
            fields["sequences"][name] = tensor
        elif kind == "mask":
            fields["masks"][name] = tensor.bool()
        elif kind == "timestamps":
            fields["timestamps"][name] = tensor
        elif kind == "ids":
            fields["ids"][name] = tensor
        else:
            fields[kind] = tensor
    return ModelInput(**fields)


def _encode(state: dict[str, torch.Tensor], keys: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """State dict -> tuple for the wire (contiguous, as gloo needs); bool tensors become float 0/1."""
    return tuple((state[k].float() if state[k].dtype == torch.bool else state[k]).contiguous() for k in keys)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it travels back over gloo, which needs that
    (e.g. BST's head concatenates its inputs, so their gradients are strided slices)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _decode(
    keys: tuple[str, ...], tensors: tuple[torch.Tensor, ...], bool_keys: frozenset[str]
) -> dict[str, torch.Tensor]:
    """Wire tuple -> state dict: masks back to bool, gradients of the rest made contiguous."""
    return {
        k: (t > 0.5 if k in bool_keys else _ContiguousGradient.apply(t) if t.requires_grad else t)
        for k, t in zip(keys, tensors, strict=True)
    }


@dataclass(frozen=True)
class StageSignature:
    """Key orders at the stage boundaries, learned from a dry run: the input, the state, the outputs."""

    input_keys: tuple[str, ...]
    state_keys: tuple[str, ...]
    bool_keys: frozenset[str]
    output_keys: tuple[str, ...]


class StageModule(nn.Module):
    """Parts ``[start, stop)`` of the chain, taking and returning tuples of tensors (what pipelining moves)."""

    def __init__(
        self, parts: list[nn.Module], span: range, num_parts: int, signature: StageSignature
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts[i] for i in span)
        self.first = span.start == 0
        self.last = span.stop == num_parts
        self.signature = signature

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        s = self.signature
        state: Any = (
            unflatten_input(s.input_keys, tensors)
            if self.first
            else _decode(s.state_keys, tensors, s.bool_keys)
        )
        for part in self.parts:
            state = part(state)
        if self.last:
            outputs = tuple(state[k] for k in s.output_keys)
            return outputs[0] if len(outputs) == 1 else outputs
        return _encode(state, s.state_keys)


def learn_signature(model: nn.Module, inp: ModelInput) -> StageSignature:
    """Dry run of the chain on the first sample, without gradients, to learn the boundary keys."""
    parts = model_parts(model)
    keys = input_keys(inp)
    one = unflatten_input(keys, tuple(t[:1].detach() for t in flatten_input(inp, keys)))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        state = parts[0](one)
        out = parts[-1](state)
    model.train(was_training)
    if "negatives_logits" in out:  # sampled softmax (SASRec, HSTU)
        loss_outputs: tuple[str, ...] = ("pos_logits", "negatives_logits")
    elif "pos_logits" in out:  # BCE with one negative per position
        loss_outputs = ("pos_logits", "neg_logits")
    else:
        loss_outputs = ("logits",)
    return StageSignature(
        keys,
        tuple(sorted(state)),
        frozenset(k for k, v in state.items() if v.dtype == torch.bool),
        loss_outputs,
    )


# -- loss -----------------------------------------------------------------------------------------
class MicrobatchLoss:
    """Loss of one micro-batch, normalised by the whole batch so that micro-batch losses sum to the mean.

    Next-item models (target the (B, L) real-position mask): with outputs ``(pos_logits, neg_logits)``
    (B, L) each, the summed positive and negative BCE over real positions; with outputs
    ``(pos_logits, negatives_logits)`` (B, L) and (B, L, N), the summed sampled-softmax cross-entropy
    (`psrec.models.sasrec.sampled_softmax_loss`); either / the batch's real positions.
    CTR models such as BST (outputs ``logits``, target the (B,) labels): the summed BCE / the batch size.
    """

    def __init__(self) -> None:
        self.normalizer = 1.0

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple) and output[1].ndim == 3:
            positive, negatives = output
            real = target.bool()
            loss = sampled_softmax_loss(positive[real], negatives[real], reduction="sum")
        elif isinstance(output, tuple):
            positive, negative = output
            real = target.bool()
            loss = functional.binary_cross_entropy_with_logits(
                positive[real], torch.ones_like(positive[real]), reduction="sum"
            ) + functional.binary_cross_entropy_with_logits(
                negative[real], torch.zeros_like(negative[real]), reduction="sum"
            )
        else:
            loss = functional.binary_cross_entropy_with_logits(
                output, target.to(output.dtype), reduction="sum"
            )
        return loss / self.normalizer


def batch_normalizer(target: torch.Tensor) -> float:
    """Count the whole-batch loss is a mean over: real positions (a (B, L) mask) or samples (B,)."""
    return float(target.bool().sum()) if target.ndim == 2 else float(target.shape[0])


def microbatches_for(batch_size: int, n_microbatches: int, num_stages: int, schedule: str) -> tuple[int, str]:
    """(micro-batches, schedule) for one batch size: the most micro-batches up to `n_microbatches` that
    split the batch evenly (a stage's buffers have one shape), and GPipe where 1F1B would need more
    micro-batches than stages. The arithmetic is the same either way; only the overlap differs."""
    count = max(d for d in range(1, min(n_microbatches, batch_size) + 1) if batch_size % d == 0)
    if schedule == "1f1b" and count < num_stages:
        return count, "gpipe"
    return count, schedule


def _detached(output: Any) -> Any:
    if isinstance(output, tuple):
        return tuple(t.detach() for t in output)
    return output.detach() if isinstance(output, torch.Tensor) else output


# -- the stepper ----------------------------------------------------------------------------------
class PipelineStepper:
    """This rank's stage of a pipeline replica, plus the data-parallel average across replicas.

    Every rank of the world must construct it (it creates the process subgroups collectively).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: PipelineLayout,
        *,
        n_microbatches: int,
        schedule: str = "gpipe",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.model = model
        self.layout = layout
        self.rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"layout is for {layout.world_size} ranks, the group has {dist.get_world_size()}"
            )
        self.stage = layout.stage_of(self.rank)
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        self.parts = model_parts(model)
        self.spans = split_parts(len(self.parts), layout.num_stages)
        self.is_first = self.stage == 0
        self.is_last = self.stage == layout.num_stages - 1
        # Subgroups: every rank creates every group, in the same order.
        self.pipeline_group = self.data_parallel_group = None
        for replica in range(layout.num_replicas):
            group = dist.new_group(layout.pipeline_ranks(replica))
            if replica == layout.replica_of(self.rank):
                self.pipeline_group = group
        for stage in range(layout.num_stages):
            group = dist.new_group(layout.data_parallel_ranks(stage))
            if stage == self.stage:
                self.data_parallel_group = group
        self.loss_fn = MicrobatchLoss()
        self.stage_module: StageModule | None = None
        self._schedules: dict[int, Any] = {}  # batch size -> schedule over its own PipelineStage
        self.last_output: Any = None  # the last stage's merged outputs of the latest step (detached)

    def _build_module(self, inp: ModelInput | None) -> StageModule:
        """This rank's `StageModule`; the first stage learns the boundary keys and tells the others."""
        replica_ranks = self.layout.pipeline_ranks(self.layout.replica_of(self.rank))
        signature = [learn_signature(self.model, inp)] if inp is not None else [None]
        dist.broadcast_object_list(signature, src=replica_ranks[0], group=self.pipeline_group)
        learned = signature[0]
        if learned is None:
            raise RuntimeError("pipeline: the first stage did not broadcast the stage signature")
        return StageModule(self.parts, self.spans[self.stage], len(self.parts), learned)

    def _schedule_for(self, batch_size: int) -> Any:
        """The schedule for batches of `batch_size` (the stage's buffers have fixed shapes; one per size)."""
        if batch_size not in self._schedules:
            assert self.stage_module is not None
            n_microbatches, schedule = microbatches_for(
                batch_size, self.n_microbatches, self.layout.num_stages, self.schedule_name
            )
            stage = PipelineStage(
                self.stage_module,
                self.stage,
                self.layout.num_stages,
                torch.device("cpu"),
                group=self.pipeline_group,
            )
            self._schedules[batch_size] = SCHEDULES[schedule](
                stage, n_microbatches, loss_fn=self.loss_fn, scale_grads=False
            )
        return self._schedules[batch_size]

    def stage_parameters(self, stage: int | None = None) -> list[nn.Parameter]:
        """The parameters of `stage` (default: this rank's), which only that stage's ranks train."""
        span = self.spans[self.stage if stage is None else stage]
        unique = {id(p): p for i in span for p in self.parts[i].parameters()}
        return list(unique.values())

    def stage_buffers(self, stage: int) -> list[torch.Tensor]:
        unique = {id(b): b for i in self.spans[stage] for b in self.parts[i].buffers()}
        return list(unique.values())

    def step(
        self, inp: ModelInput | None, target: torch.Tensor | None, *, batch_size: int | None = None
    ) -> float | None:
        """Forward and backward of one batch; the first stage passes `inp`, the last `target`.

        Batches may differ in size (not in sequence length): every stage needs the batch size, which
        the first and last stage take from `inp` / `target` and a middle stage must be given. Returns
        the batch loss on the last stage (None elsewhere), whose outputs are kept in `last_output`.
        Afterwards this rank's stage parameters hold the replica-averaged gradients, and on the first
        stage the leaf tensors that built `inp` hold their gradients.
        """
        if self.is_first and inp is None:
            raise ValueError("the first stage needs the batch's ModelInput")
        if self.is_last and target is None:
            raise ValueError("the last stage needs the batch's target (labels or real-position mask)")
        if batch_size is None:
            if inp is not None:
                batch_size = int(inp.dense.shape[0])
            elif target is not None:
                batch_size = int(target.shape[0])
            else:
                raise ValueError("a middle stage needs the batch size")
        if self.stage_module is None:
            self.stage_module = self._build_module(inp if self.is_first else None)
        schedule = self._schedule_for(batch_size)
        for parameter in self.stage_module.parameters():
            parameter.grad = None
        losses: list[torch.Tensor] = []
        if self.is_last:
            assert target is not None
            self.loss_fn.normalizer = max(batch_normalizer(target), 1.0)
        args = flatten_input(inp, self.stage_module.signature.input_keys) if self.is_first and inp else ()
        # The schedule gets leaves: micro-batches are slices, and tensors built from shared rows (the
        # client gathers every sequence from one pulled table) would be backpropagated once per slice.
        leaves = tuple(a.detach().requires_grad_(a.requires_grad) for a in args)
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        output = schedule.step(*leaves, **kwargs)
        built = [(a, leaf.grad) for a, leaf in zip(args, leaves, strict=True) if leaf.grad is not None]
        if built:  # one backward from the input's gradients into whatever built it (the pulled rows)
            torch.autograd.backward([a for a, _ in built], [g for _, g in built])
        self.last_output = _detached(output) if self.is_last else None
        self._average_gradients()
        return float(sum(loss.detach() for loss in losses)) if self.is_last else None

    def skip_step(self) -> None:
        """A step without a batch on this replica (its share of the data ran out before the others'):
        zero gradients join the replica average, so the other replicas' steps complete."""
        for parameter in self.stage_parameters():
            parameter.grad = torch.zeros_like(parameter)
        self._average_gradients()

    def _average_gradients(self) -> None:
        if self.layout.num_replicas == 1:
            return
        parameters = self.stage_parameters()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        means = allreduce_mean(grads, self.layout.num_replicas, group=self.data_parallel_group)
        for parameter, mean in zip(parameters, means, strict=True):
            parameter.grad = mean.clone()
