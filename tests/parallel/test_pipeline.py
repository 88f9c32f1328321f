"""Pipeline parallel SASRec/BST: the 2-stage pipeline gives the unsplit model's loss and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from psrec.models import BehaviorSequenceTransformer, ModelInput, SASRec
from psrec.parallel.launch import run_local_group
from psrec.parallel.pipeline import PipelineLayout, PipelineStepper, model_parts, split_parts

BATCH, LENGTH, DIM = 8, 6, 8


def make_sasrec() -> SASRec:
    torch.manual_seed(0)
    return SASRec(DIM, max_length=LENGTH, num_blocks=2, num_heads=2, dropout=0.0)


def make_bst() -> BehaviorSequenceTransformer:
    torch.manual_seed(0)
    return BehaviorSequenceTransformer(
        3, 2, DIM, target_feature_index=0, max_length=LENGTH, num_blocks=2, dropout=0.0, hidden_sizes=(16,)
    )


def make_input(kind: str, seed: int, batch: int = BATCH) -> tuple[ModelInput, torch.Tensor]:
    """A fixed batch whose embedding tensors are leaves (as the client's pulled rows are)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (batch,), generator=generator)
    mask = torch.arange(LENGTH).flip(0).unsqueeze(0) < lengths.unsqueeze(1)  # left-padded, (B, L)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    if kind == "sasrec":
        sequences = {
            "seq": leaf(batch, LENGTH, DIM),
            "pos": leaf(batch, LENGTH, DIM),
            "neg": leaf(batch, LENGTH, DIM),
        }
        inp = ModelInput(torch.zeros(batch, 0), torch.zeros(batch, 0, DIM), None, sequences, {"seq": mask})
        return inp, mask.float()
    inp = ModelInput(
        torch.randn(batch, 3, generator=generator),
        leaf(batch, 2, DIM),
        None,
        {"history": leaf(batch, LENGTH, DIM)},
        {"history": mask},
    )
    return inp, torch.randint(0, 2, (batch,), generator=generator).float()


def make_model(kind: str) -> torch.nn.Module:
    return make_sasrec() if kind == "sasrec" else make_bst()


def input_grads(inp: ModelInput) -> dict[str, torch.Tensor]:
    grads = {f"sequence:{k}": v.grad for k, v in inp.sequences.items()}
    if inp.pooled.grad is not None:
        grads["pooled"] = inp.pooled.grad
    return {k: v.clone() for k, v in grads.items() if v is not None}


def oracle(kind: str, seeds: list[int]) -> dict[str, Any]:
    """The unsplit model on each replica's batch; gradients averaged over replicas (mean of mean losses)."""
    model = make_model(kind)
    losses, inputs = [], []
    for seed in seeds:
        inp, target = make_input(kind, seed)
        loss, _ = model.loss(inp, None if kind == "sasrec" else target)
        (loss / len(seeds)).backward()
        losses.append(float(loss.detach()))
        inputs.append(input_grads(inp))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": losses, "grads": grads, "inputs": inputs}


def run_stage(rank: int, world_size: int, kind: str, num_stages: int, schedule: str) -> dict[str, Any]:
    layout = PipelineLayout(world_size, num_stages)
    model = make_model(kind)
    stepper = PipelineStepper(model, layout, n_microbatches=4, schedule=schedule)
    inp, target = make_input(kind, seed=layout.replica_of(rank))
    loss = stepper.step(inp if stepper.is_first else None, target if stepper.is_last else None)
    own = {id(p) for p in stepper.stage_parameters()}
    grads = {
        name: p.grad.clone() for name, p in model.named_parameters() if id(p) in own and p.grad is not None
    }
    return {
        "loss": loss,
        "grads": grads,
        "inputs": input_grads(inp) if stepper.is_first else {},
        "stage": stepper.stage,
    }


def check(results: list[dict[str, Any]], want: dict[str, Any], layout: PipelineLayout) -> None:
    seen: set[str] = set()
    for rank, result in enumerate(results):
        replica = layout.replica_of(rank)
        if result["stage"] == layout.num_stages - 1:
            assert result["loss"] == pytest.approx(want["losses"][replica], rel=1e-5)
        else:
            assert result["loss"] is None
        if result["stage"] == 0:  # the embedding rows' gradients, to push to the PS
            scale = layout.num_replicas  # the oracle's input grads carry the 1/R of the replica mean
            assert set(result["inputs"]) == set(want["inputs"][replica])
            for key, grad in result["inputs"].items():
                torch.testing.assert_close(grad / scale, want["inputs"][replica][key], rtol=1e-4, atol=1e-6)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, want["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(want["grads"])  # every parameter lives on some stage and was checked


def test_split_parts_keeps_embedding_first_and_head_last() -> None:
    assert split_parts(4, 2) == [range(0, 2), range(2, 4)]  # [emb, b0] | [b1, head]
    assert split_parts(3, 2) == [range(0, 1), range(1, 3)]  # [emb] | [b0, head]
    assert split_parts(6, 3) == [range(0, 2), range(2, 3), range(3, 6)]  # 4 blocks: 1, 1, 2
    assert split_parts(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError, match="stages"):
        split_parts(3, 4)


def test_layout_maps_ranks_to_replicas_and_stages() -> None:
    layout = PipelineLayout(4, 2)
    assert [(layout.replica_of(r), layout.stage_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.pipeline_ranks(1) == [2, 3] and layout.data_parallel_ranks(1) == [1, 3]
    with pytest.raises(ValueError, match="multiple"):
        PipelineLayout(3, 2)


@pytest.mark.parametrize("kind", ["sasrec", "bst"])
def test_chained_parts_equal_the_forward(kind: str) -> None:
    model = make_model(kind)
    inp, _ = make_input(kind, 0)
    state: Any = inp
    for part in model_parts(model):
        state = part(state)
    if kind == "sasrec":
        torch.testing.assert_close(state["pos_logits"], model.run(inp)["pos_logits"])
    else:
        torch.testing.assert_close(state["logits"], model(inp))


@pytest.mark.parametrize(("kind", "schedule"), [("sasrec", "gpipe"), ("sasrec", "1f1b"), ("bst", "1f1b")])
def test_two_stage_pipeline_equals_the_unsplit_model(kind: str, schedule: str) -> None:
    layout = PipelineLayout(2, 2)
    results = run_local_group(run_stage, world_size=2, args=(kind, 2, schedule))
    check(results, oracle(kind, [0]), layout)


def test_two_replicas_of_two_stages_average_like_the_unsplit_model() -> None:
    layout = PipelineLayout(4, 2)
    results = run_local_group(run_stage, world_size=4, args=("sasrec", 2, "1f1b"))
    check(results, oracle("sasrec", [0, 1]), layout)
