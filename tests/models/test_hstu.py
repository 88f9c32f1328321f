"""HSTU: the jagged computation equals the padded, masked dense oracle (forward and gradients), attention
is causal, the length groups are the cheapest cut, and the model learns a next-item rule.

    pytest tests/models/test_hstu.py
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from psrec.models.base import ModelInput
from psrec.models.hstu import HSTU
from psrec.models.hstu_attention import RelativeAttentionBias, dense_attention, jagged_attention, time_buckets
from psrec.models.jagged import (
    JaggedLayout,
    from_group,
    pack,
    partition_by_length,
    split_groups,
    to_group,
    unpack,
)
from psrec.trainer.metrics import hit_rate, sampled_ranks

BATCH, LENGTH, DIM, NUM_ITEMS = 9, 12, 8, 40


def left_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width).flip(0).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, L)


def random_lengths(generator: torch.Generator, batch: int = BATCH, width: int = LENGTH) -> list[int]:
    lengths = torch.randint(1, width + 1, (batch,), generator=generator).tolist()
    lengths[0] = width  # one full row
    return lengths


def test_layout_of_the_worked_example() -> None:
    layout = JaggedLayout.from_mask(left_padded_mask([3, 1, 2], 4))
    assert layout.order.tolist() == [0, 2, 1]
    assert layout.offsets.tolist() == [0, 3, 5, 6]
    assert layout.padded_index.tolist() == [1, 2, 3, 10, 11, 7]
    assert layout.positions.tolist() == [0, 1, 2, 0, 1, 0]
    padded = torch.randn(3, 4, 5)
    mask = left_padded_mask([3, 1, 2], 4)
    round_trip = unpack(pack(padded, layout), layout)
    torch.testing.assert_close(round_trip, padded * mask.unsqueeze(-1), rtol=0, atol=0)


def brute_force_cost(lengths: list[int], overhead: int) -> float:
    """The cheapest cut of sorted lengths into contiguous runs, over every cut."""
    best = math.inf
    for cuts in itertools.product([False, True], repeat=len(lengths) - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut]
        stops = starts[1:] + [len(lengths)]
        best = min(
            best, sum((b - a) * lengths[a] ** 2 + overhead for a, b in zip(starts, stops, strict=True))
        )
    return best


@pytest.mark.parametrize("overhead", [0, 10, 100, 10_000])
def test_length_groups_are_the_cheapest_contiguous_cut(overhead: int) -> None:
    rng = np.random.default_rng(overhead)
    for _ in range(20):
        lengths = sorted(rng.integers(1, 30, size=int(rng.integers(1, 9))).tolist(), reverse=True)
        runs = partition_by_length(np.array(lengths), group_overhead=overhead)
        assert [a for a, _ in runs][0] == 0 and runs[-1][1] == len(lengths)
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(runs))
        cost = sum((b - a) * lengths[a] ** 2 + overhead for a, b in runs)
        assert cost == pytest.approx(brute_force_cost(lengths, overhead))
    assert partition_by_length(np.array([5, 5, 3, 0, 0]), group_overhead=0) == [
        (0, 2),
        (2, 3),
    ]  # empties dropped
    assert partition_by_length(np.array([9, 5, 3]), group_overhead=10**9) == [(0, 3)]  # dense
    with pytest.raises(ValueError, match="sorted"):
        partition_by_length(np.array([1, 2]))


def test_time_buckets_are_the_references_log_buckets() -> None:
    gaps = torch.tensor([0, 1, -1, 2, 3, 60, -3600, 86400, 10**9, 10**18])
    want = [min(128, max(0, int(math.log(max(abs(g), 1)) / 0.301))) for g in gaps.tolist()]
    assert time_buckets(gaps, 128).tolist() == want
    assert time_buckets(torch.tensor([10**18]), 128).item() == 128  # clamped


def test_position_bias_matches_the_references_toeplitz_weights() -> None:
    """The reference keeps 2n - 1 weights w and biases (i, j) by w[n - 1 + j - i]; ours reads distance i - j."""
    n = 7
    reference = torch.randn(2 * n - 1)
    # the reference's construction: pad, tile, cut into rows shifted by one
    tiled = torch.nn.functional.pad(reference, [0, n]).repeat(n)[:-n].reshape(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    reference_bias = tiled[:, r:-r]  # (n, n)
    bias = RelativeAttentionBias(n)
    with torch.no_grad():
        bias.position_weights.copy_(reference[:n].flip(0))  # distance d = i - j -> w[n - 1 - d]
    index = torch.arange(n)
    ours = bias.position(index.unsqueeze(1) - index.unsqueeze(0))
    causal = index.unsqueeze(1) >= index.unsqueeze(0)
    torch.testing.assert_close(ours[causal], reference_bias[causal])


@pytest.mark.parametrize("width", [1, 5, 7, 10])
def test_position_matrix_equals_the_distance_lookup(width: int) -> None:
    """The Hankel construction of rab_p equals indexing the weights by i - j (0 above the diagonal)."""
    bias = RelativeAttentionBias(7)
    index = torch.arange(width)
    distance = index.unsqueeze(1) - index.unsqueeze(0)
    want = bias.position(distance) * (distance >= 0)
    torch.testing.assert_close(bias.position_matrix(width), want, rtol=0, atol=0)


def test_pack_and_group_gradients_are_exact() -> None:
    """The hand-written backward passes of pack / unpack / to_group / from_group (gradcheck, float64)."""
    mask = left_padded_mask([3, 1, 4, 2, 4], 4)
    layout = JaggedLayout.from_mask(mask, group_overhead=1)
    padded = torch.randn(5, 4, 2, dtype=torch.float64, requires_grad=True)

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        chunks = split_groups(pack(x, layout) * 2.0, layout)
        blocks = [to_group(chunk, group) ** 2 for chunk, group in zip(chunks, layout.groups, strict=True)]
        tokens = torch.cat(
            [from_group(block, group) for block, group in zip(blocks, layout.groups, strict=True)]
        )
        return unpack(tokens, layout)

    assert len(layout.groups) > 1
    assert torch.autograd.gradcheck(round_trip, (padded,))


def attention_inputs(seed: int, heads: int = 2, dqk: int = 3, dv: int = 4, times: bool = True):
    generator = torch.Generator().manual_seed(seed)
    lengths = random_lengths(generator)
    mask = left_padded_mask(lengths, LENGTH)
    q = torch.randn(BATCH, LENGTH, heads, dqk, generator=generator)
    k = torch.randn(BATCH, LENGTH, heads, dqk, generator=generator)
    v = torch.randn(BATCH, LENGTH, heads, dv, generator=generator)
    stamps = None
    if times:
        gaps = torch.randint(0, 100_000, (BATCH, LENGTH + 1), generator=generator)
        stamps = gaps.cumsum(dim=1)  # nondecreasing seconds
    return mask, q, k, v, stamps


@pytest.mark.parametrize("overhead", [0, 50, 10**9])
@pytest.mark.parametrize("times", [False, True])
def test_jagged_attention_equals_the_dense_oracle(overhead: int, times: bool) -> None:
    mask, q, k, v, stamps = attention_inputs(seed=overhead + times, times=times)
    torch.manual_seed(0)
    bias = RelativeAttentionBias(LENGTH, num_buckets=16)
    scale = 1.0 / LENGTH

    def dense() -> torch.Tensor:
        return dense_attention(q, k, v, mask, scale=scale, bias=bias, times=stamps)

    def jagged() -> torch.Tensor:
        layout = JaggedLayout.from_mask(mask, group_overhead=overhead)
        packed = [pack(t, layout) for t in (q, k, v)]
        query_times = key_times = None
        if stamps is not None:
            query_times, key_times = pack(stamps[:, 1:], layout), pack(stamps[:, :-1], layout)
        out = jagged_attention(
            *packed, layout, scale=scale, bias=bias, query_times=query_times, key_times=key_times
        )
        return unpack(out, layout)

    gradients = []
    for run in (dense, jagged):
        for tensor in (q, k, v, *bias.parameters()):
            tensor.grad = None
            tensor.requires_grad_(True)
        out = run()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        gradients.append(
            [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (q, k, v, *bias.parameters())]
        )
        if run is dense:
            want = out.detach()
            assert (out[~mask] == 0).all()
        else:
            torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(gradients[1], gradients[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def make_model_input(seed: int, *, loss: str, times: bool, candidates: bool = False) -> ModelInput:
    """Leaf embedding tensors (as the client's pulled rows), left-padded."""
    generator = torch.Generator().manual_seed(seed)
    lengths = random_lengths(generator)
    mask = left_padded_mask(lengths, LENGTH)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    sequences = {"seq": leaf(BATCH, LENGTH, DIM), "pos": leaf(BATCH, LENGTH, DIM)}
    if loss == "bce":
        sequences["neg"] = leaf(BATCH, LENGTH, DIM)
    else:
        sequences["negatives"] = leaf(BATCH, 5, DIM)
    if candidates:
        sequences["candidates"] = leaf(BATCH, 6, DIM)
    stamps = {}
    if times:
        stamps["seq"] = torch.randint(0, 10**6, (BATCH, LENGTH + 1), generator=generator).cumsum(dim=1)
    return ModelInput(
        torch.zeros(BATCH, 0), torch.zeros(BATCH, 0, DIM), None, sequences, {"seq": mask}, timestamps=stamps
    )


def make_hstu(*, jagged: bool, loss: str = "sampled_softmax", **overrides: object) -> HSTU:
    torch.manual_seed(0)
    arguments: dict = dict(
        max_length=LENGTH, num_blocks=2, num_heads=2, attention_dim=3, linear_dim=4, dropout=0.0, loss=loss
    )
    arguments.update(overrides)
    return HSTU(DIM, jagged=jagged, **arguments)


@pytest.mark.parametrize(
    ("loss", "times"), [("sampled_softmax", False), ("sampled_softmax", True), ("bce", True)]
)
def test_jagged_model_equals_the_dense_model(loss: str, times: bool) -> None:
    """Same weights, same batch: the loss, every parameter's gradient and the input rows' gradients."""
    results = []
    for jagged in (False, True):
        model = make_hstu(jagged=jagged, loss=loss)
        inp = make_model_input(7, loss=loss, times=times)
        value, scores = model.loss(inp)
        value.backward()
        results.append(
            (
                value.detach(),
                scores,
                {
                    name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                    for name, p in model.named_parameters()
                },
                {name: t.grad.clone() for name, t in inp.sequences.items()},
            )
        )
    (dense_loss, dense_scores, dense_grads, dense_inputs), (loss_value, scores, grads, inputs) = results
    torch.testing.assert_close(loss_value, dense_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores, dense_scores, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(dense_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for name, grad in inputs.items():
        torch.testing.assert_close(grad, dense_inputs[name], rtol=1e-4, atol=1e-6, msg=name)
    assert grads["blocks.blocks.0.bias.position_weights"].abs().sum() > 0
    assert (grads["blocks.blocks.0.bias.time_weights"].abs().sum() > 0) == times


def test_candidate_scores_equal_the_dense_model_and_the_chained_block_parts() -> None:
    inp = make_model_input(3, loss="sampled_softmax", times=True, candidates=True)
    jagged, dense = make_hstu(jagged=True).eval(), make_hstu(jagged=False).eval()
    with torch.no_grad():
        want = dense.predict(inp)
        torch.testing.assert_close(jagged.predict(inp), want, rtol=1e-5, atol=1e-5)
        state = jagged.embedding(inp)
        for part in jagged.blocks.block_parts():
            state = part(state)
        torch.testing.assert_close(jagged.head(state)["candidate_logits"], want, rtol=1e-5, atol=1e-5)
    assert want.shape == (BATCH, 6)


@pytest.mark.parametrize("jagged", [True, False])
def test_no_position_sees_the_future_or_the_padding(jagged: bool) -> None:
    """d hidden_i / d seq_j is zero for every future item j > i and for padded slots."""
    model = make_hstu(jagged=jagged).eval()
    inp = make_model_input(11, loss="sampled_softmax", times=True)
    mask = inp.masks["seq"]
    sequence = inp.sequences["seq"]
    row = int(torch.nonzero(mask.sum(1) < LENGTH)[0])  # a row with padding
    for query in range(LENGTH):
        sequence.grad = None
        hidden = model.run(inp)["hidden"]  # (B, L, D)
        hidden[row, query].sum().backward()
        influence = sequence.grad[row].abs().sum(-1)  # (L,)
        assert (influence[query + 1 :] == 0).all(), f"position {query} sees the future"
        assert (influence[~mask[row]] == 0).all(), "padding influences a position"
        if mask[row, query]:
            assert influence[query] > 0


def test_hstu_learns_the_next_item() -> None:
    """The next item is always the last one plus 1 (mod N): a rule only the sequence reveals."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        table = nn.Parameter(torch.randn(NUM_ITEMS + 1, DIM) * 0.02)
        model = HSTU(DIM, max_length=6, num_blocks=1, num_heads=1, attention_dim=8, linear_dim=8, dropout=0.1)
        optimizer = torch.optim.Adam([table, *model.parameters()], lr=0.01, betas=(0.9, 0.98))

        def sequences(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            start = torch.randint(0, NUM_ITEMS, (batch, 1), generator=generator)
            items = (start + torch.arange(7)) % NUM_ITEMS + 1  # (B, 7)
            lengths = torch.randint(2, 8, (batch, 1), generator=generator)
            mask = torch.arange(7) >= (7 - lengths)
            return items * mask, mask

        for _ in range(120):
            items, mask = sequences(64)
            negatives = torch.randint(1, NUM_ITEMS + 1, (64, 16), generator=generator)
            inp = ModelInput(
                torch.zeros(64, 0),
                torch.zeros(64, 0, DIM),
                sequences={
                    "seq": table[items[:, :-1]],
                    "pos": table[items[:, 1:]],
                    "negatives": table[negatives],
                },
                masks={"seq": mask[:, :-1], "pos": mask[:, 1:]},
            )
            loss, _ = model.loss(inp)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        items, mask = sequences(200)
        candidates = torch.cat(
            [items[:, -1:], torch.randint(1, NUM_ITEMS + 1, (200, 9), generator=generator)], 1
        )
        model.eval()
        with torch.no_grad():
            scores = model.predict(
                ModelInput(
                    torch.zeros(200, 0),
                    torch.zeros(200, 0, DIM),
                    sequences={"seq": table[items[:, :-1]], "candidates": table[candidates]},
                    masks={"seq": mask[:, :-1]},
                )
            )
        assert hit_rate(sampled_ranks(scores, ties="optimistic"), 1) > 0.8
    finally:
        torch.set_num_threads(threads)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="loss"):
        HSTU(DIM, loss="mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        HSTU(DIM, temperature=0.0)
    model = make_hstu(jagged=True)
    inp = make_model_input(0, loss="sampled_softmax", times=False)
    with pytest.raises(ValueError, match="candidates"):
        model(inp)
    with pytest.raises(ValueError, match="up to"):
        model.embedding(
            ModelInput(
                torch.zeros(1, 0),
                torch.zeros(1, 0, DIM),
                sequences={"seq": torch.zeros(1, LENGTH + 1, DIM)},
                masks={"seq": torch.ones(1, LENGTH + 1, dtype=torch.bool)},
            )
        )
