"""How many pipeline stages a sequence model needs: the memory of each stage of an HSTU, per device.

A pure function over plain numbers, no torch: `plan_stages(size, memory_bytes=..., ...)` cuts the
model's parts ``[embedding, block 0, ..., block n-1, head]`` as `psrec.parallel.pipeline` cuts them
(`split_parts`: the embedding first, the head last, the blocks dealt out evenly) into the fewest
stages whose every device holds its stage, and returns the `StagePlan` (or raises `StagesDoNotFit`
naming the memory one block needs). `psrec plan RUN_CONFIG --memory-gb G` prints it
(`psrec.parallel.cli`). The item table is not on these devices: its rows live on the parameter
server (`psrec plan SPEC` places them).

Memory model, bytes, float32 (B = sequences per micro-batch, L = ``max_length``, T = B L tokens, D =
embedding dim, H heads, dqk / dv per head, W = 2 H (dv + dqk), N negatives per sequence):

- weights: 16 per parameter (weight, gradient, Adam's two moments). A block has D W + H dv D + D
  (W_uvqk, W_o, b_o) + L + 129 (relative position and time bias weights); the embedding stage L D
  (positions); the head none.
- activations kept for the backward pass, per micro-batch (every sequence L long: the worst case):
  a block ``T (8 D + 12 W + 14 H dv + 16) + 9 B H L^2 + 1024 B + 5 L^2``: the layer norms' inputs,
  the projections before and after SiLU, the packed per-group copies of Q, K, V, the gated output
  and its dropout mask (per token), the attention scores before and after SiLU (per query-key
  pair), and the relative bias and causal mask shared by the batch.
  An upper bound of what autograd saves, within 1.15x of it (`tests/parallel/test_stage_planner.py`
  counts the saved tensors). The embedding stage ``T (9 D) + 8 B (2 L + N) D`` (its output and
  dropout mask, the pulled rows of "seq", "pos" and the negatives with their gradients); the head
  ``12 B L N + 12 (T + B N) D`` (the sampled softmax's logits, the normalised states and items).
- in flight: a GPipe stage keeps all M micro-batches' activations; a 1F1B stage s of S keeps
  ``min(M, S - s)`` (`in_flight`); one stage is no pipeline: the whole batch in one pass.
- between stages, per micro-batch: the state a stage sends on (``message_bytes``: "hidden" T D,
  the mask T, and the targets the head reads, "pos" T D and the negatives B N D), one receive and
  one send buffer per stage boundary it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["gpipe", "1f1b"]
FLOAT = 4
BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + Adam's first and second moments
NUM_TIME_BUCKETS = 128  # psrec.models.hstu's


@dataclass(frozen=True)
class HSTUSize:
    """The sizes that decide an HSTU's memory (`psrec.models.config.HSTUConfig` and the item dim)."""

    embedding_dim: int
    max_length: int
    num_blocks: int
    num_heads: int
    attention_dim: int  # dqk per head
    linear_dim: int  # dv per head
    num_negatives: int = 128  # the sampled softmax's, per sequence

    @property
    def projection_width(self) -> int:
        """W = 2 H (dv + dqk): the width of U, V, Q, K together."""
        return 2 * self.num_heads * (self.linear_dim + self.attention_dim)


def block_parameters(size: HSTUSize) -> int:
    """Parameters of one HSTU block."""
    dim, heads_dv = size.embedding_dim, size.num_heads * size.linear_dim
    return dim * size.projection_width + heads_dv * dim + dim + size.max_length + NUM_TIME_BUCKETS + 1


def embedding_parameters(size: HSTUSize) -> int:
    """Parameters of the embedding stage (learned positions; the item rows are on the PS)."""
    return size.max_length * size.embedding_dim


def block_activation_bytes(size: HSTUSize, sequences: int) -> int:
    """Bytes one block keeps for its backward pass for `sequences` full-length sequences."""
    length, dim = size.max_length, size.embedding_dim
    tokens = sequences * length
    per_token = 8 * dim + 12 * size.projection_width + 14 * size.num_heads * size.linear_dim + 16
    pairs = length * length
    return tokens * per_token + 9 * sequences * size.num_heads * pairs + 1024 * sequences + 5 * pairs


def embedding_activation_bytes(size: HSTUSize, sequences: int) -> int:
    """Bytes the embedding stage keeps per micro-batch: its output, dropout mask, rows and their gradients."""
    dim, length = size.embedding_dim, size.max_length
    rows = sequences * (2 * length + size.num_negatives) * dim
    return sequences * length * 9 * dim + 2 * FLOAT * rows


def head_activation_bytes(size: HSTUSize, sequences: int) -> int:
    """Bytes the head keeps per micro-batch: sampled-softmax logits and the normalised vectors."""
    tokens = sequences * size.max_length
    logits = sequences * size.max_length * size.num_negatives
    vectors = (tokens + sequences * size.num_negatives) * size.embedding_dim
    return 3 * FLOAT * logits + 3 * FLOAT * vectors


def message_bytes(size: HSTUSize, sequences: int) -> int:
    """Bytes one micro-batch's state takes from one stage to the next (hidden, mask, pos, negatives)."""
    tokens = sequences * size.max_length
    return FLOAT * (
        2 * tokens * size.embedding_dim + tokens + sequences * size.num_negatives * size.embedding_dim
    )


def split_parts(num_parts: int, num_stages: int) -> list[range]:
    """Cut parts ``[embedding, blocks..., head]`` into contiguous stages: blocks dealt out evenly.

    The embedding (part 0) is always in the first stage and the head (the last part) in the last.
    """
    num_blocks = num_parts - 2
    if num_stages < 1 or num_blocks < 0 or num_stages > num_blocks + 2:
        raise ValueError(f"cannot cut {num_blocks} blocks + embedding + head into {num_stages} stages")
    if num_stages == 1:
        return [range(0, num_parts)]
    # Stage boundaries in block units: stage s gets blocks [s * n / S, (s + 1) * n / S).
    bounds = [1 + (s * num_blocks) // num_stages for s in range(num_stages + 1)]
    bounds[0], bounds[-1] = 0, num_parts
    stages = [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    if any(len(stage) == 0 for stage in stages):
        raise ValueError(f"cannot cut {num_blocks} blocks into {num_stages} non-empty stages")
    return stages


def in_flight(stage: int, num_stages: int, microbatches: int, schedule: Schedule) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak (one stage: no pipeline, the
    whole batch in one pass)."""
    if num_stages == 1 or schedule == "gpipe":
        return microbatches
    return min(microbatches, num_stages - stage)


def stage_counts(num_blocks: int) -> list[int]:
    """The stage counts `split_parts` can cut `num_blocks` blocks + embedding + head into."""
    counts = []
    for num_stages in range(1, num_blocks + 3):
        try:
            split_parts(num_blocks + 2, num_stages)
        except ValueError:
            continue
        counts.append(num_stages)
    return counts


@dataclass(frozen=True)
class StageMemory:
    """One stage: its parts (0 = embedding, last = head), blocks, and the bytes it needs."""

    parts: tuple[int, int]  # [first, last) part indexes
    blocks: int
    weight_bytes: int
    activation_bytes: int
    buffer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.buffer_bytes


@dataclass(frozen=True)
class StagePlan:
    """The fewest stages that fit, each stage's memory, and the bytes between stages per step."""

    num_stages: int
    stages: list[StageMemory]
    memory_bytes: int
    microbatch_sequences: int
    microbatches: int
    schedule: Schedule
    bytes_between_stages_per_step: int  # forward activations + backward gradients, all boundaries

    @property
    def peak_bytes(self) -> int:
        return max(stage.total_bytes for stage in self.stages)


class StagesDoNotFit(ValueError):
    """Even one block per stage does not fit a device; the message says what one block needs."""


def stage_memory(
    size: HSTUSize, num_stages: int, *, microbatch_sequences: int, microbatches: int, schedule: Schedule
) -> list[StageMemory]:
    """The memory of every stage when the model is cut into `num_stages` (`split_parts`)."""
    num_parts = size.num_blocks + 2
    out = []
    message = message_bytes(size, microbatch_sequences)
    for stage, parts in enumerate(split_parts(num_parts, num_stages)):
        blocks = sum(1 for part in parts if 0 < part < num_parts - 1)
        weights = blocks * block_parameters(size) + (embedding_parameters(size) if 0 in parts else 0)
        per_microbatch = blocks * block_activation_bytes(size, microbatch_sequences)
        if 0 in parts:
            per_microbatch += embedding_activation_bytes(size, microbatch_sequences)
        if num_parts - 1 in parts:
            per_microbatch += head_activation_bytes(size, microbatch_sequences)
        boundaries = (stage > 0) + (stage < num_stages - 1)
        out.append(
            StageMemory(
                parts=(parts.start, parts.stop),
                blocks=blocks,
                weight_bytes=BYTES_PER_PARAMETER * weights,
                activation_bytes=in_flight(stage, num_stages, microbatches, schedule) * per_microbatch,
                buffer_bytes=2 * boundaries * message,
            )
        )
    return out


def plan_stages(
    size: HSTUSize,
    *,
    memory_bytes: int,
    batch_size: int,
    microbatches: int = 4,
    schedule: Schedule = "1f1b",
) -> StagePlan:
    """The fewest pipeline stages of `size` whose every stage fits `memory_bytes` per device.

    `batch_size` sequences per step per pipeline replica, split into `microbatches` (rounded up).
    """
    if memory_bytes <= 0 or batch_size < 1 or microbatches < 1:
        raise ValueError("memory_bytes, batch_size and microbatches must be positive")
    sequences = math.ceil(batch_size / microbatches)
    message = message_bytes(size, sequences)
    peaks = {}
    for num_stages in stage_counts(size.num_blocks):
        stages = stage_memory(
            size, num_stages, microbatch_sequences=sequences, microbatches=microbatches, schedule=schedule
        )
        peaks[num_stages] = max(stage.total_bytes for stage in stages)
        if peaks[num_stages] <= memory_bytes:
            return StagePlan(
                num_stages=num_stages,
                stages=stages,
                memory_bytes=memory_bytes,
                microbatch_sequences=sequences,
                microbatches=microbatches,
                schedule=schedule,
                bytes_between_stages_per_step=2 * (num_stages - 1) * microbatches * message,
            )
    fewest = min(peaks, key=lambda count: (peaks[count], count))
    raise StagesDoNotFit(
        f"{size.num_blocks} blocks do not fit {memory_bytes / 1e9:.3g} GB per device in any number of "
        f"stages: the least any cut needs is {peaks[fewest] / 1e9:.3g} GB ({fewest} stages) with "
        f"micro-batches of {sequences} sequences x {size.max_length} positions; use more "
        "micro-batches, a smaller batch or larger devices"
    )
