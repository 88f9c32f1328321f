"""HSTU training speed on this machine: tokens/s for 1, 2 and 4 pipeline stages, and the bytes between stages.

    python -m psrec.bench.hstu_pipeline_bench [--steps 5] [--rounds 1] [--blocks 8] [--json out.json]

The model is HSTU-large's shape on MovieLens-1M by default (`examples/ml1m_hstu_large.yaml`: dim 50,
length 200, 8 blocks x 2 heads, dqk = dv = 25, dropout 0.2, sampled softmax over 128 negatives per
user), batch 128, packed (jagged) blocks. The input is synthetic and in memory (no reader, no PS):
each sequence's length is drawn uniformly from 20 to 200, its rows are leaf tensors as the client's
pulled rows are. Cases, each in fresh forked processes with one torch thread each
(`psrec.parallel.launch.run_local_group`), rounds interleaved:

- 1 stage: the unsplit model in one process (`HSTU.loss`, backward, Adam);
- 2 and 4 stages: `PipelineStepper` with 1F1B over 4 micro-batches, one process per stage (gloo on
  loopback), each stepping its own stage's parameters.

Reported per case: tokens/s (real positions trained per second: positions whose next item is the
target), steps/s, and the bytes passed between stages per step, ``2 (S - 1) M x`` the bytes of one
micro-batch's state as the first stage sends it (its tensors counted: "hidden", the mask as float,
"pos" and the negatives; the backward pass sends a gradient of the same size back). On a machine with
fewer cores than stages the stages share cores: the figure is then the cost of the split, not its
speed-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any

import torch

from psrec.models import HSTU, ModelInput
from psrec.parallel.launch import run_local_group
from psrec.parallel.pipeline import PipelineLayout, PipelineStepper

logger = logging.getLogger(__name__)

DIM, LENGTH, HEADS, HEAD_DIM, NEGATIVES, BATCH, MICROBATCHES = 50, 200, 2, 25, 128, 128, 4
SHORTEST = 20
WARMUP = 2


def make_model(num_blocks: int) -> HSTU:
    torch.manual_seed(0)
    return HSTU(
        DIM,
        max_length=LENGTH,
        num_blocks=num_blocks,
        num_heads=HEADS,
        attention_dim=HEAD_DIM,
        linear_dim=HEAD_DIM,
        dropout=0.2,
    )


def make_input(seed: int, batch: int) -> tuple[ModelInput, torch.Tensor]:
    """A batch of left-padded sequences with lengths uniform in [SHORTEST, LENGTH], rows as leaves."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(SHORTEST, LENGTH + 1, (batch,), generator=generator)
    mask = torch.arange(LENGTH).flip(0).unsqueeze(0) < lengths.unsqueeze(1)  # (B, L)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    sequences = {
        "seq": leaf(batch, LENGTH, DIM),
        "pos": leaf(batch, LENGTH, DIM),
        "negatives": leaf(batch, NEGATIVES, DIM),
    }
    inp = ModelInput(torch.zeros(batch, 0), torch.zeros(batch, 0, DIM), None, sequences, {"seq": mask})
    return inp, mask.float()


def message_bytes_measured(model: HSTU, inp: ModelInput, microbatches: int) -> int:
    """Bytes of one micro-batch's state as the embedding stage sends it (every tensor as float32)."""
    rows = inp.sequences["seq"].shape[0] // microbatches
    part = ModelInput(
        inp.dense[:rows],
        inp.pooled[:rows],
        None,
        {name: tensor[:rows] for name, tensor in inp.sequences.items()},
        {name: mask[:rows] for name, mask in inp.masks.items()},
    )
    with torch.no_grad():
        state = model.embedding(part)
    return sum(tensor.numel() * 4 for tensor in state.values())


def run_case(rank: int, world_size: int, num_blocks: int, steps: int) -> dict[str, Any]:
    """One process of a case with `world_size` stages (1: the unsplit model)."""
    model = make_model(num_blocks)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    inp, target = make_input(0, BATCH)
    tokens = int(target.sum())
    message = 0
    if world_size == 1:

        def one_step() -> None:
            optimizer.zero_grad()
            loss, _ = model.loss(inp)
            loss.backward()
            optimizer.step()

    else:
        message = message_bytes_measured(model, inp, MICROBATCHES)
        stepper = PipelineStepper(
            model, PipelineLayout(world_size, world_size), n_microbatches=MICROBATCHES, schedule="1f1b"
        )

        def one_step() -> None:
            optimizer.zero_grad()
            stepper.step(
                inp if stepper.is_first else None, target if stepper.is_last else None, batch_size=BATCH
            )
            optimizer.step()  # parameters of other stages have no gradient and are skipped

    for _ in range(WARMUP):
        one_step()
    if world_size > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    seconds = time.perf_counter() - start
    between = 2 * (world_size - 1) * MICROBATCHES * message
    return {"seconds": seconds, "tokens": steps * tokens, "steps": steps, "bytes_between_stages": between}


def measure(*, steps: int, rounds: int, num_blocks: int, stages: list[int]) -> dict[int, dict[str, Any]]:
    runs: dict[int, list[list[dict[str, Any]]]] = {count: [] for count in stages}
    for _ in range(rounds):
        for count in stages:
            runs[count].append(
                run_local_group(run_case, world_size=count, args=(num_blocks, steps), timeout=600)
            )
    out = {}
    for count, results in runs.items():
        seconds = [max(rank["seconds"] for rank in ranks) for ranks in results]
        first = results[-1][0]
        out[count] = {
            "tokens_per_second": statistics.median(first["tokens"] / s for s in seconds),
            "steps_per_second": statistics.median(first["steps"] / s for s in seconds),
            "bytes_between_stages_per_step": first["bytes_between_stages"],
            "processes": count,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = measure(steps=args.steps, rounds=args.rounds, num_blocks=args.blocks, stages=args.stages)
    lines = [
        f"HSTU {args.blocks} blocks x {HEADS} heads, dim {DIM}, length {LENGTH}, batch {BATCH}, "
        f"{NEGATIVES} negatives; 1F1B over {MICROBATCHES} micro-batches; {os.cpu_count()} CPUs, "
        "one torch thread per process",
    ]
    for count, result in results.items():
        lines.append(
            f"{count} stage{'s' if count > 1 else ' '}: {result['tokens_per_second']:>9,.0f} tokens/s "
            f"{result['steps_per_second']:6.2f} steps/s  between stages "
            f"{result['bytes_between_stages_per_step'] / 1e6:7.1f} MB/step"
        )
    print("\n".join(lines))  # noqa: T201 - a command's report
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
