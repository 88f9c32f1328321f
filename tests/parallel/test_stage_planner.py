"""The HSTU stage planner against what autograd really keeps, and `psrec plan RUN_CONFIG`.

The oracle counts the bytes of every tensor autograd saves for the backward pass (distinct storages,
parameters left out) while a block, or the whole model's loss, runs forward in training mode.

    pytest tests/parallel/test_stage_planner.py
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from psrec.cli import main
from psrec.models.base import ModelInput
from psrec.models.hstu import HSTU
from psrec.parallel.stage_planner import (
    HSTUSize,
    StagesDoNotFit,
    block_activation_bytes,
    block_parameters,
    embedding_activation_bytes,
    embedding_parameters,
    head_activation_bytes,
    message_bytes,
    plan_stages,
    split_parts,
    stage_counts,
    stage_memory,
)


def saved_bytes(run: Callable[[], Any], parameters: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `run` runs, parameters excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def model_and_input(size: HSTUSize, sequences: int) -> tuple[HSTU, ModelInput]:
    torch.manual_seed(0)
    model = HSTU(
        size.embedding_dim,
        max_length=size.max_length,
        num_blocks=size.num_blocks,
        num_heads=size.num_heads,
        attention_dim=size.attention_dim,
        linear_dim=size.linear_dim,
    ).train()
    length, dim = size.max_length, size.embedding_dim

    def rows(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dim, requires_grad=True)

    full = torch.ones(sequences, length, dtype=torch.bool)
    inp = ModelInput(
        torch.zeros(sequences, 0),
        torch.zeros(sequences, 0, dim),
        None,
        {
            "seq": rows(sequences, length),
            "pos": rows(sequences, length),
            "negatives": rows(sequences, size.num_negatives),
        },
        {"seq": full, "pos": full},
    )
    return model, inp


SHAPES = list(itertools.product([3, 8], [20, 64], [16, 50], [1, 2], [8, 25]))


@pytest.mark.parametrize(("sequences", "length", "dim", "heads", "head_dim"), SHAPES)
def test_block_activations_bound_what_autograd_saves_within_15_percent(
    sequences: int, length: int, dim: int, heads: int, head_dim: int
) -> None:
    size = HSTUSize(dim, length, 1, heads, head_dim, head_dim, num_negatives=4)
    model, inp = model_and_input(size, sequences)
    state = model.embedding(inp)
    state = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in state.items()}
    [block] = model.blocks.block_parts()
    measured = saved_bytes(lambda: block(state), list(model.parameters()))
    assert measured <= block_activation_bytes(size, sequences) <= 1.15 * measured
    assert sum(p.numel() for p in block.parameters()) == block_parameters(size)
    assert model.embedding.positions.numel() == embedding_parameters(size)


@pytest.mark.parametrize(("blocks", "negatives"), [(1, 16), (3, 64)])
def test_the_whole_loss_keeps_no_more_than_the_stage_model_says(blocks: int, negatives: int) -> None:
    size = HSTUSize(32, 40, blocks, 2, 16, 16, num_negatives=negatives)
    model, inp = model_and_input(size, 6)
    measured = saved_bytes(lambda: model.loss(inp), list(model.parameters()))
    [stage] = stage_memory(size, 1, microbatch_sequences=6, microbatches=1, schedule="1f1b")
    assert stage.activation_bytes == (
        embedding_activation_bytes(size, 6)
        + blocks * block_activation_bytes(size, 6)
        + head_activation_bytes(size, 6)
    )
    assert measured <= stage.activation_bytes <= 1.5 * measured


def test_message_bytes_are_the_state_a_stage_sends() -> None:
    """The embedding stage's output as the pipeline sends it (bool masks as float)."""
    size = HSTUSize(24, 30, 2, 1, 8, 8, num_negatives=12)
    model, inp = model_and_input(size, 5)
    state = model.embedding(inp)
    sent = sum(t.numel() * 4 for t in state.values())  # every tensor travels as float32
    assert message_bytes(size, 5) == sent


def test_the_plan_is_the_fewest_stages_that_fit() -> None:
    size = HSTUSize(50, 200, 8, 2, 25, 25)
    peaks = {
        count: max(
            stage.total_bytes
            for stage in stage_memory(size, count, microbatch_sequences=32, microbatches=4, schedule="1f1b")
        )
        for count in stage_counts(8)
    }
    assert stage_counts(8) == list(range(1, 10))  # 10 stages would leave one empty
    for peak in peaks.values():
        plan = plan_stages(size, memory_bytes=peak, batch_size=128, microbatches=4)
        assert plan.num_stages == min(c for c, p in peaks.items() if p <= peak)
        assert plan.peak_bytes <= peak
        assert plan.bytes_between_stages_per_step == 2 * (plan.num_stages - 1) * 4 * message_bytes(size, 32)
    one = plan_stages(size, memory_bytes=10**12, batch_size=128, microbatches=4)
    assert one.num_stages == 1 and one.bytes_between_stages_per_step == 0
    with pytest.raises(StagesDoNotFit, match="in any number of stages: the least any cut needs"):
        plan_stages(size, memory_bytes=min(peaks.values()) - 1, batch_size=128, microbatches=4)
    # the planner cuts as the pipeline does
    from psrec.parallel import pipeline

    assert pipeline.split_parts is split_parts


def test_psrec_plan_of_a_run_config_prints_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "examples/ml1m_hstu_large.yaml", "--memory-gb", "0.5"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("hstu: 2 pipeline stages for 0.50 GB per device"), first
    assert main(["plan", "examples/ml1m_hstu_large.yaml", "--memory-gb", "0.01"]) == 2
    assert "refused: 8 blocks do not fit" in capsys.readouterr().err
    assert main(["plan", "examples/ml1m_sasrec.yaml", "--memory-gb", "1"]) == 2
    assert "stages of an hstu model, not 'sasrec'" in capsys.readouterr().err
