"""Train the plain PyTorch SASRec oracle (`psrec.testing.sasrec_reference`) on an interactions file.

The reference code's training loop (a shuffled pass over the users per epoch, batches of 128, one
fresh negative per position, Adam with betas (0.9, 0.98) over everything), evaluated on psrec's own
leave-one-out sets (`psrec.data.sequences.evaluation_batches`, all users, seed 2018), so its numbers
compare with `psrec train` directly. Switches put one of psrec's former choices back in (the
ablation table of docs/results.md). One JSON line per epoch.

    python -m psrec.bench.sasrec_oracle --epochs 20 --eval-at 5,10,20
    python -m psrec.bench.sasrec_oracle --epochs 5 --eval-at 5 --item-std 0.1
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
from torch import nn

from psrec.data.sequences import evaluation_batches, load_interactions
from psrec.testing.sasrec_reference import (
    ReferenceSASRec,
    reference_init,
    reference_loss,
    reference_training_rows,
)
from psrec.trainer.metrics import sampled_ranks

BATCH = 128


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", default="../shared/data/beauty/Beauty.txt")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval-at", default="5,10,20", help="epochs after which to evaluate")
    parser.add_argument("--max-length", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mask-keys", action="store_true", help="mask padded keys (as psrec)")
    parser.add_argument("--item-std", type=float, help="item table N(0, std) instead of Xavier-normal")
    parser.add_argument("--position-std", type=float, help="positions N(0, std) instead of Xavier-normal")
    parser.add_argument("--torch-layer-init", action="store_true", help="PyTorch's default layer init")
    parser.add_argument("--lazy-items", action="store_true", help="lazy Adam (per-row steps) on the items")
    parser.add_argument("--dense-beta2", type=float, default=0.98, help="Adam beta2 of the non-item weights")
    return parser.parse_args()


def build(args: argparse.Namespace, num_items: int) -> ReferenceSASRec:
    model = ReferenceSASRec(
        num_items, 50, max_length=args.max_length, dropout=args.dropout, mask_padded_keys=args.mask_keys
    )
    reference_init(model, args.seed)
    with torch.no_grad():
        if args.item_std is not None:
            model.item_emb.weight.normal_(0, args.item_std)
            model.item_emb.weight[0] = 0
        if args.position_std is not None:
            model.pos_emb.weight.normal_(0, args.position_std)
        if args.torch_layer_init:
            for module in model.modules():
                if isinstance(module, nn.Conv1d):
                    module.reset_parameters()
                if isinstance(module, nn.MultiheadAttention):
                    for part in module.in_proj_weight.data.chunk(3):  # as three nn.Linear
                        nn.init.kaiming_uniform_(part, a=math.sqrt(5))
                    nn.init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
    return model


class LazyAdam:
    """Adam on the rows in the batch only, with a step count per row (psrec's lazy table update)."""

    def __init__(self, weight: torch.Tensor, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.98)):
        self.weight, self.lr, self.betas = weight, lr, betas
        self.m, self.v = torch.zeros_like(weight), torch.zeros_like(weight)
        self.steps = torch.zeros(weight.shape[0])

    @torch.no_grad()
    def step(self, rows: torch.Tensor) -> None:
        assert self.weight.grad is not None
        beta1, beta2 = self.betas
        grad = self.weight.grad[rows]
        self.steps[rows] += 1
        t = self.steps[rows].unsqueeze(1)
        self.m[rows] = beta1 * self.m[rows] + (1 - beta1) * grad
        self.v[rows] = beta2 * self.v[rows] + (1 - beta2) * grad * grad
        denominator = self.v[rows].sqrt() / (1 - beta2**t).sqrt() + 1e-8
        self.weight[rows] -= self.lr / (1 - beta1**t) * self.m[rows] / denominator  # torch.optim.Adam's
        self.weight.grad = None


def main() -> None:
    args = parse_arguments()
    torch.set_num_threads(1)
    data = load_interactions([args.path])
    train = [data.split(index)[0] for index in range(data.users.size)]
    users = np.flatnonzero([sequence.size >= 2 for sequence in train])
    model = build(args, data.num_items)
    others = [p for name, p in model.named_parameters() if name != "item_emb.weight"]
    groups: list[dict] = [{"params": others, "betas": (0.9, args.dense_beta2)}]
    lazy = LazyAdam(model.item_emb.weight) if args.lazy_items else None
    if lazy is None:
        groups.append({"params": [model.item_emb.weight], "betas": (0.9, 0.98)})
    optimizer = torch.optim.Adam(groups, lr=1e-3)
    rng = np.random.default_rng(args.seed)
    evaluate_at = {int(epoch) for epoch in args.eval_at.split(",")}
    order, cursor, start = rng.permutation(users), 0, time.time()

    def evaluate(split: str) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            ranks = np.concatenate(
                [
                    sampled_ranks(
                        model.predict(
                            torch.from_numpy(batch.sequences["seq"].ids),
                            torch.from_numpy(batch.sequences["candidates"].ids),
                        )
                    )
                    for batch in evaluation_batches(
                        data, split=split, max_length=args.max_length, batch_size=2048, seed=2018
                    )
                ]
            )
        model.train()
        return float((ranks < 10).mean()), float(np.where(ranks < 10, 1 / np.log2(ranks + 2), 0).mean())

    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for _ in range(users.size // BATCH):
            if cursor + BATCH > order.size:
                order, cursor = rng.permutation(users), 0
            batch_users, cursor = order[cursor : cursor + BATCH], cursor + BATCH
            rows = reference_training_rows(train, batch_users, data.num_items, args.max_length, rng)
            seq, pos, neg = (torch.from_numpy(ids) for ids in rows)
            positive_logits, negative_logits = model(seq, pos, neg)  # (B, L) each
            loss = reference_loss(positive_logits, negative_logits, pos)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if lazy is not None:
                touched = torch.unique(torch.cat([seq.flatten(), pos.flatten(), neg.flatten()]))
                lazy.step(touched[touched != 0])
            total += float(loss.detach())
        line: dict = {
            "epoch": epoch,
            "loss": total / (users.size // BATCH),
            "seconds": round(time.time() - start),
        }
        if epoch in evaluate_at:
            line["validation"], line["test"] = evaluate("valid"), evaluate("test")
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
