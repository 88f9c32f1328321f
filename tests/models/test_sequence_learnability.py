"""BST and SASRec learn a synthetic next-item rule: the next item is always the last one plus 1 (mod N).

Plain nn.Parameter item tables stand in for the parameter server (row 0 is padding). Neither task can be
solved without reading the sequence: the target item alone says nothing about the label.
"""

import torch
import torch.nn.functional as functional
from torch import nn

from psrec.models import BehaviorSequenceTransformer, SASRec
from psrec.models.base import ModelInput
from psrec.trainer.metrics import auc, hit_rate, sampled_ranks

NUM_ITEMS, LENGTH, DIM = 30, 6, 16


def cyclic_sequences(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Item ids in 1..NUM_ITEMS, (batch, LENGTH + 1), each following its predecessor, and the real mask."""
    start = torch.randint(0, NUM_ITEMS, (batch, 1), generator=generator)
    items = (start + torch.arange(LENGTH + 1)) % NUM_ITEMS + 1
    lengths = torch.randint(2, LENGTH + 2, (batch, 1), generator=generator)
    mask = torch.arange(LENGTH + 1) >= (LENGTH + 1 - lengths)  # left-padded
    return items * mask, mask


def with_single_thread(function):
    def wrapper() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            function()
        finally:
            torch.set_num_threads(threads)

    wrapper.__name__ = function.__name__
    return wrapper


@with_single_thread
def test_sasrec_learns_next_item() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    table = nn.Parameter(torch.randn(NUM_ITEMS + 1, DIM) * 0.1)
    model = SASRec(DIM, max_length=LENGTH, num_blocks=1, num_heads=2, dropout=0.1)
    optimizer = torch.optim.Adam([table, *model.parameters()], lr=0.01)
    for _ in range(150):
        items, mask = cyclic_sequences(64, generator)
        negatives = torch.randint(1, NUM_ITEMS + 1, (64, LENGTH), generator=generator)
        inp = ModelInput(
            dense=torch.zeros(64, 0),
            pooled=torch.zeros(64, 0, DIM),
            sequences={"seq": table[items[:, :-1]], "pos": table[items[:, 1:]], "neg": table[negatives]},
            masks={"seq": mask[:, :-1], "pos": mask[:, 1:]},
        )
        loss, _ = model.loss(inp)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    items, mask = cyclic_sequences(200, generator)
    candidates = torch.cat([items[:, -1:], torch.randint(1, NUM_ITEMS + 1, (200, 9), generator=generator)], 1)
    model.eval()
    with torch.no_grad():
        scores = model.predict(
            ModelInput(
                dense=torch.zeros(200, 0),
                pooled=torch.zeros(200, 0, DIM),
                sequences={"seq": table[items[:, :-1]], "candidates": table[candidates]},
                masks={"seq": mask[:, :-1]},
            )
        )
    assert hit_rate(sampled_ranks(scores, ties="optimistic"), 1) > 0.8


@with_single_thread
def test_bst_learns_that_the_target_follows_the_history() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    table = nn.Parameter(torch.randn(NUM_ITEMS + 1, DIM) * 0.1)
    model = BehaviorSequenceTransformer(
        0, 1, DIM, target_feature_index=0, max_length=LENGTH, num_heads=2, hidden_sizes=[32, 16]
    )
    optimizer = torch.optim.Adam([table, *model.parameters()], lr=0.005)

    def batch(size: int) -> tuple[ModelInput, torch.Tensor]:
        items, mask = cyclic_sequences(size, generator)
        labels = torch.randint(0, 2, (size,), generator=generator).float()
        random_items = torch.randint(1, NUM_ITEMS + 1, (size,), generator=generator)
        target = torch.where(labels > 0, items[:, -1], random_items)
        labels = (target == items[:, -1]).float()
        inp = ModelInput(
            dense=torch.zeros(size, 0),
            pooled=table[target].unsqueeze(1),  # (B, 1, D): the target item is the only pooled feature
            sequences={"history": table[items[:, :-1]]},
            masks={"history": mask[:, :-1]},
        )
        return inp, labels

    for _ in range(400):
        inp, labels = batch(64)
        loss, _ = model.loss(inp, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    inp, labels = batch(500)
    model.eval()
    with torch.no_grad():
        assert auc(labels, model.predict(inp)) > 0.9
    assert functional.binary_cross_entropy(model.predict(inp).detach(), labels) < 0.5
