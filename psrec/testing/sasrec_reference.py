"""A plain, self-contained PyTorch SASRec: the test oracle for `psrec.models.sasrec`.

It follows the widely used PyTorch port of SASRec (pmixer/SASRec.pytorch, its original design) in
every choice that changes the numbers, written here from the algorithm, with no psrec code:

- item table ``nn.Embedding(num_items + 1, D, padding_idx=0)``; positions ``nn.Embedding(L, D)``
  indexed 0..L-1 over the left-padded window of fixed length L;
- ``x = Dropout(E[seq] * sqrt(D) + P) * mask``; per block ``q = LN(x); x = q + MHA(q, x, x)`` with a
  causal mask only (padded keys stay visible: their value is the key/value bias); ``x = LN(x);
  x = (x + FFN(x)) * mask``, FFN ``Dropout(W2 relu(Dropout(W1 x)))``; a final LN; layer norms with
  eps 1e-8;
- ``mask_padded_keys=True`` hides padded keys instead (every position still attends itself), as
  psrec (and the original TensorFlow SASRec, which masks keys whose embedding sums to zero) do;
- loss ``BCE(r_pos, 1) + BCE(r_neg, 0)``, each averaged over the positions whose next item is real;
- init: Xavier-normal on every parameter with two or more dimensions (item and position tables,
  attention in-projection and out-projection, FFN weights), biases and layer norms at PyTorch's
  defaults, padding row zero; one `torch.optim.Adam(lr, betas=(0.9, 0.98))` over all parameters, the
  item table included (dense: untouched rows keep moving with their moments).

`reference_training_rows` builds training rows as the reference's sampler does: the last
``max_length`` (input, next item) pairs of each user's training sequence, right-aligned, and one
fresh negative per position drawn from the items the user never trained on.

Used by tests/models (psrec's SASRec against it, step by step) and `psrec.bench.sasrec_oracle`
(this model trained on a real data set).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as functional
from torch import nn


class ReferenceFeedForward(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=1)
        self.dropout1 = nn.Dropout(dropout)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=1)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D)
        hidden = self.conv1(x.transpose(-1, -2))
        out = self.dropout2(self.conv2(torch.relu(self.dropout1(hidden)))).transpose(-1, -2)
        return out + x


class ReferenceSASRec(nn.Module):
    def __init__(
        self,
        num_items: int,
        dim: int,
        *,
        max_length: int,
        num_blocks: int = 2,
        num_heads: int = 1,
        dropout: float = 0.2,
        mask_padded_keys: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.mask_padded_keys = mask_padded_keys
        self.item_emb = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.pos_emb = nn.Embedding(max_length, dim)
        self.emb_dropout = nn.Dropout(dropout)
        self.attention_layernorms = nn.ModuleList(nn.LayerNorm(dim, eps=1e-8) for _ in range(num_blocks))
        self.attention_layers = nn.ModuleList(
            nn.MultiheadAttention(dim, num_heads, dropout=dropout) for _ in range(num_blocks)
        )
        self.forward_layernorms = nn.ModuleList(nn.LayerNorm(dim, eps=1e-8) for _ in range(num_blocks))
        self.forward_layers = nn.ModuleList(ReferenceFeedForward(dim, dropout) for _ in range(num_blocks))
        self.last_layernorm = nn.LayerNorm(dim, eps=1e-8)

    def log2feats(self, seq: torch.Tensor) -> torch.Tensor:
        """seq (B, L) item ids, 0 = padding, left-padded -> (B, L, D)."""
        x = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim)
        positions = torch.arange(seq.shape[1]).expand_as(seq)
        x = self.emb_dropout(x + self.pos_emb(positions))
        keep = (seq != 0).unsqueeze(-1)
        x = x * keep
        length = seq.shape[1]
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
        blocked = ~causal  # (L, L)
        if self.mask_padded_keys:
            allowed = (causal & (seq != 0).unsqueeze(1)) | torch.eye(length, dtype=torch.bool)  # (B, L, L)
            blocked = (~allowed).repeat_interleave(self.num_heads, dim=0)  # (B * H, L, L)
        for norm, attention, forward_norm, forward in zip(
            self.attention_layernorms,
            self.attention_layers,
            self.forward_layernorms,
            self.forward_layers,
            strict=True,
        ):
            x = x.transpose(0, 1)  # (L, B, D): MultiheadAttention's layout
            query = norm(x)
            attended, _ = attention(query, x, x, attn_mask=blocked, need_weights=False)
            x = (query + attended).transpose(0, 1)
            x = forward(forward_norm(x)) * keep
        return self.last_layernorm(x)

    def forward(
        self, seq: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) ids each -> (positive logits, negative logits), (B, L) each."""
        feats = self.log2feats(seq)
        return (feats * self.item_emb(pos)).sum(-1), (feats * self.item_emb(neg)).sum(-1)

    def predict(self, seq: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """seq (B, L), candidates (B, C) -> (B, C) scores from the last position."""
        last = self.log2feats(seq)[:, -1]  # (B, D)
        return torch.einsum("bd,bcd->bc", last, self.item_emb(candidates))


def reference_init(model: ReferenceSASRec, seed: int) -> None:
    """Xavier-normal on every parameter of two or more dimensions; the padding row zero."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim >= 2:
                nn.init.xavier_normal_(parameter)
        model.item_emb.weight[0] = 0.0


def reference_optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))


def reference_loss(pos_logits: torch.Tensor, neg_logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    real = pos != 0
    positive, negative = pos_logits[real], neg_logits[real]
    return functional.binary_cross_entropy_with_logits(
        positive, torch.ones_like(positive)
    ) + functional.binary_cross_entropy_with_logits(negative, torch.zeros_like(negative))


def reference_training_rows(
    train: list[np.ndarray], users: np.ndarray, num_items: int, max_length: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, pos, neg), (B, max_length) each, for the users' training sequences (as the sampler)."""
    seq = np.zeros((users.size, max_length), np.int64)
    pos = np.zeros_like(seq)
    neg = np.zeros_like(seq)
    for row, user in enumerate(users.tolist()):
        items = train[user]
        history = set(items.tolist())
        kept = items[-(max_length + 1) :]
        count = kept.size - 1
        seq[row, max_length - count :] = kept[:-1]
        pos[row, max_length - count :] = kept[1:]
        for column in range(max_length - count, max_length):
            negative = int(rng.integers(1, num_items + 1))
            while negative in history:
                negative = int(rng.integers(1, num_items + 1))
            neg[row, column] = negative
    return seq, pos, neg
