"""Pipeline parallel SASRec/BST/HSTU: the 2-stage pipeline gives the unsplit model's loss and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from psrec.models import HSTU, BehaviorSequenceTransformer, ModelInput, SASRec
from psrec.parallel.launch import run_local_group
from psrec.parallel.pipeline import PipelineLayout, PipelineStepper, model_parts
from psrec.parallel.stage_planner import split_parts

BATCH, LENGTH, DIM = 8, 6, 8
NEXT_ITEM = ("sasrec", "hstu", "hstu_softmax")  # models whose loss ignores labels


def make_sasrec() -> SASRec:
    torch.manual_seed(0)
    return SASRec(DIM, max_length=LENGTH, num_blocks=2, num_heads=2, dropout=0.0)


def make_hstu(loss: str) -> HSTU:
    torch.manual_seed(0)
    return HSTU(
        DIM,
        max_length=LENGTH,
        num_blocks=2,
        num_heads=2,
        attention_dim=3,
        linear_dim=4,
        dropout=0.0,
        loss=loss,
    )  # type: ignore[arg-type]


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
    if kind.startswith("hstu"):  # the sampled softmax with timestamps (the time bias), or BCE without
        sequences = {"seq": leaf(batch, LENGTH, DIM), "pos": leaf(batch, LENGTH, DIM)}
        times, ids = {}, {}
        if kind == "hstu_softmax":
            sequences["negatives"] = leaf(batch, 5, DIM)
            times["seq"] = torch.randint(0, 10**6, (batch, LENGTH + 1), generator=generator).cumsum(1)
            # item numbers from a few items, so that some draws are their position's own next item
            # (masked by the loss): the numbers travel between stages with the rows
            ids = {
                "pos": torch.randint(0, 4, (batch, LENGTH), generator=generator),
                "negatives": torch.randint(0, 4, (batch, 5), generator=generator),
            }
        else:
            sequences["neg"] = leaf(batch, LENGTH, DIM)
        inp = ModelInput(
            torch.zeros(batch, 0),
            torch.zeros(batch, 0, DIM),
            None,
            sequences,
            {"seq": mask},
            timestamps=times,
            ids=ids,
        )
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
    if kind.startswith("hstu"):
        return make_hstu("sampled_softmax" if kind == "hstu_softmax" else "bce")
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
        loss, _ = model.loss(inp, None if kind in NEXT_ITEM else target)
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


@pytest.mark.parametrize("kind", ["sasrec", "bst", "hstu", "hstu_softmax"])
def test_chained_parts_equal_the_forward(kind: str) -> None:
    model = make_model(kind)
    inp, _ = make_input(kind, 0)
    state: Any = inp
    for part in model_parts(model):
        state = part(state)
    if kind in NEXT_ITEM:
        torch.testing.assert_close(state["pos_logits"], model.run(inp)["pos_logits"])
    else:
        torch.testing.assert_close(state["logits"], model(inp))


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [("sasrec", "gpipe"), ("sasrec", "1f1b"), ("bst", "1f1b"), ("hstu", "1f1b"), ("hstu_softmax", "gpipe")],
)
def test_two_stage_pipeline_equals_the_unsplit_model(kind: str, schedule: str) -> None:
    layout = PipelineLayout(2, 2)
    results = run_local_group(run_stage, world_size=2, args=(kind, 2, schedule))
    check(results, oracle(kind, [0]), layout)


@pytest.mark.parametrize("kind", ["sasrec", "hstu_softmax"])
def test_two_replicas_of_two_stages_average_like_the_unsplit_model(kind: str) -> None:
    layout = PipelineLayout(4, 2)
    results = run_local_group(run_stage, world_size=4, args=(kind, 2, "1f1b"))
    check(results, oracle(kind, [0, 1]), layout)


def test_microbatches_split_each_batch_evenly() -> None:
    from psrec.parallel.pipeline import microbatches_for

    assert microbatches_for(8, 4, 2, "1f1b") == (4, "1f1b")
    assert microbatches_for(10, 4, 2, "1f1b") == (2, "1f1b")  # the most up to 4 that divide 10
    assert microbatches_for(6, 4, 2, "gpipe") == (3, "gpipe")
    assert microbatches_for(7, 4, 2, "1f1b") == (1, "gpipe")  # 1F1B needs as many as stages
    assert microbatches_for(2, 4, 2, "1f1b") == (2, "1f1b")


def gathered_sasrec_input(seed: int, batch: int) -> tuple[ModelInput, torch.Tensor, torch.Tensor]:
    """Sequences gathered from ONE leaf row table, as the PS client builds them (not leaves themselves)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(20, DIM, generator=generator).requires_grad_(True)
    lengths = torch.randint(1, LENGTH + 1, (batch,), generator=generator)
    mask = torch.arange(LENGTH).flip(0).unsqueeze(0) < lengths.unsqueeze(1)
    sequences = {
        name: rows.index_select(0, torch.randint(0, 20, (batch * LENGTH,), generator=generator)).view(
            batch, LENGTH, DIM
        )
        for name in ("seq", "pos", "neg")
    }
    inp = ModelInput(torch.zeros(batch, 0), torch.zeros(batch, 0, DIM), None, sequences, {"seq": mask})
    return inp, mask.float(), rows


def run_varying_batches(rank: int, world_size: int, sizes: list[int]) -> dict[str, Any]:
    stepper = PipelineStepper(make_sasrec(), PipelineLayout(world_size, 2), n_microbatches=4, schedule="1f1b")
    losses, row_grads, grads = [], [], []
    for seed, size in enumerate(sizes):
        inp, target, rows = gathered_sasrec_input(seed, size)
        losses.append(stepper.step(inp if stepper.is_first else None, target if stepper.is_last else None))
        row_grads.append(rows.grad.clone() if stepper.is_first and rows.grad is not None else None)
        grads.append({id(p): p.grad.clone() for p in stepper.stage_parameters() if p.grad is not None})
    own = {id(p): name for name, p in stepper.model.named_parameters()}
    return {
        "losses": losses,
        "rows": row_grads,
        "grads": [{own[key]: grad for key, grad in step.items()} for step in grads],
    }


def test_batches_of_changing_size_from_shared_rows_equal_the_unsplit_model() -> None:
    """Each batch size gets its own schedule (10: 2 micro-batches, 7: 1, GPipe), and the rows that
    built several sequences get one gradient, as in the unsplit backward."""
    sizes = [8, 10, 7, 8]
    results = run_local_group(run_varying_batches, world_size=2, args=(sizes,))
    model = make_sasrec()
    for step, size in enumerate(sizes):
        model.zero_grad(set_to_none=True)
        inp, _, rows = gathered_sasrec_input(step, size)
        loss, _ = model.loss(inp, None)
        loss.backward()
        assert results[1]["losses"][step] == pytest.approx(float(loss.detach()), rel=1e-5)
        torch.testing.assert_close(results[0]["rows"][step], rows.grad, rtol=1e-4, atol=1e-6)
        checked = {**results[0]["grads"][step], **results[1]["grads"][step]}
        assert set(checked) == {name for name, p in model.named_parameters() if p.grad is not None}
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(checked[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def run_skipping_replica(rank: int, world_size: int) -> dict[str, Any]:
    layout = PipelineLayout(world_size, 2)
    model = make_sasrec()
    stepper = PipelineStepper(model, layout, n_microbatches=4, schedule="1f1b")
    if layout.replica_of(rank) == 1:
        stepper.skip_step()  # out of data: zero gradients into the average
        inp = None
    else:
        inp, target = make_input("sasrec", 0)
        stepper.step(inp if stepper.is_first else None, target if stepper.is_last else None)
    own = {id(p) for p in stepper.stage_parameters()}
    return {
        "grads": {name: p.grad.clone() for name, p in model.named_parameters() if id(p) in own},
        "inputs": input_grads(inp) if inp is not None and stepper.is_first else {},
    }


def test_a_replica_without_a_batch_contributes_zero_gradients() -> None:
    results = run_local_group(run_skipping_replica, world_size=4)
    want = oracle("sasrec", [0])  # replica 0's batch alone ...
    for result in results:
        for name, grad in result["grads"].items():  # ... averaged with replica 1's zeros
            torch.testing.assert_close(grad, want["grads"][name] / 2, rtol=1e-4, atol=1e-6, msg=name)
    for key, grad in results[0]["inputs"].items():
        torch.testing.assert_close(grad, want["inputs"][0][key], rtol=1e-4, atol=1e-6)
