"""Self-attention blocks shared by BST and SASRec.

Math (B = batch, L = sequence length, D = model dim, H = heads):

- `MultiHeadAttention`: ``softmax(Q K^T / sqrt(D / H) + mask) V`` per head with learned Q/K/V/output
  projections; dropout on the attention weights. Queries and keys/values may differ (SASRec normalises
  only the queries).
- `TransformerBlock`, two published layouts:
    ``"post"`` (Vaswani et al.; BST):  x = LN(x + Dropout(Attn(x, x)));  x = LN(x + FFN(x))
    ``"pre"``  (SASRec, Kang & McAuley 2018, as its reference code):
               q = LN(x);  x = q + Attn(q, x);  x = LN(x);  x = x + FFN(x)
  with ``FFN(x) = Dropout(W2 act(Dropout(W1 x)))``.
- `TransformerStack`: a stack of blocks over ``state = {"hidden": (B, L, D), "mask": (B, L) bool}``
  (True = real item). Position q may attend key k when k is a real item (and k <= q when causal);
  every position may always attend itself, so a padded position never has an empty softmax (its output
  is meaningless and is zeroed after each block). The stack builds that rule once as an additive
  float mask (`attention_bias`: 0 or -inf) shared by its blocks.

Attention runs in PyTorch's ``scaled_dot_product_attention`` (fused kernels where the device has one;
a float mask is taken as is, a boolean one would be converted on every call), except when training
with dropout on CPU: no CPU kernel fuses dropout, and SDPA's unfused path draws the dropout mask with
``bernoulli_``, about 3x slower here than ``rand >= p`` and the largest single cost of a SASRec step
at length 200. `attention_with_dropout` writes that path out with the faster draw (`dropout_keep`),
and `Dropout` uses it for the other dropouts; with dropout 0 it equals SDPA (tested), with dropout
it is the same distribution from a different random stream.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as functional
from torch import nn

from psrec.models.layers import make_activation

NormPosition = Literal["pre", "post"]


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"model dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.dropout = dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, dim)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        return x.view(batch, length, self.num_heads, dim // self.num_heads).transpose(1, 2)  # (B, H, L, D/H)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """query (B, Lq, D), key_value (B, Lk, D), bias (B, 1, Lq, Lk) additive mask -> (B, Lq, D)."""
        q = self._split_heads(self.query(query))
        k = self._split_heads(self.key(key_value))
        v = self._split_heads(self.value(key_value))
        bias = bias.to(q.dtype)  # a no-op unless autocast lowered q
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and q.device.type == "cpu":
            attended = attention_with_dropout(q, k, v, bias, dropout)
        else:
            attended = functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=dropout
            )  # (B, H, Lq, D/H)
        batch, _, length, _ = attended.shape
        return self.output(attended.transpose(1, 2).reshape(batch, length, -1))


def dropout_keep(like: torch.Tensor, dropout: float) -> torch.Tensor:
    """1.0 (kept, probability ``1 - dropout``) or 0.0 per element of `like`, from ``rand >= dropout``."""
    return torch.rand_like(like).ge_(dropout)


def attention_with_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout: float
) -> torch.Tensor:
    """``Dropout(softmax(q k^T / sqrt(d) + bias)) v``: (B, H, Lq, d), (B, H, Lk, d) x2, (B, 1, Lq, Lk).

    SDPA's unfused computation with the mask of `dropout_keep` (see the module docstring); the
    ``1 / (1 - dropout)`` scale is applied to the (B, H, Lq, d) result instead of the weights.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias  # (B, H, Lq, Lk)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights * dropout_keep(weights, dropout), v) * (1.0 / (1.0 - dropout))


class Dropout(nn.Module):
    """``nn.Dropout`` whose CPU mask comes from `dropout_keep` (2x faster than ``bernoulli_`` here)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return functional.dropout(x, self.p, training=True)
        return x * dropout_keep(x, self.p) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


class FeedForward(nn.Module):
    """Position-wise FFN: (B, L, D) -> (B, L, D), ``Dropout(W2 act(Dropout(W1 x)))``."""

    def __init__(self, dim: int, hidden_dim: int, *, activation: str, dropout: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, hidden_dim),
            Dropout(dropout),
            make_activation(activation),
            nn.Linear(hidden_dim, dim),
            Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        ffn_dim: int,
        dropout: float,
        activation: str = "relu",
        norm_position: NormPosition = "post",
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_position = norm_position
        self.attention = MultiHeadAttention(dim, num_heads, dropout=dropout)
        self.attention_dropout = Dropout(dropout)
        self.attention_norm = nn.LayerNorm(dim, eps=norm_eps)
        self.ffn = FeedForward(dim, ffn_dim, activation=activation, dropout=dropout)
        self.ffn_norm = nn.LayerNorm(dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, L, D), bias (B, 1, L, L) from `attention_bias` -> (B, L, D)."""
        if self.norm_position == "pre":
            query = self.attention_norm(x)
            x = query + self.attention(query, x, bias)
            x = self.ffn_norm(x)
            return x + self.ffn(x)
        x = self.attention_norm(x + self.attention_dropout(self.attention(x, x, bias)))
        return self.ffn_norm(x + self.ffn(x))


def attention_allowed(mask: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """(B, L) bool real-item mask -> (B, L, L) bool: may query q attend key k."""
    length = mask.shape[1]
    allowed = mask.unsqueeze(1).expand(-1, length, -1)  # (B, Lq, Lk): key k is real
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return allowed | torch.eye(length, dtype=torch.bool, device=mask.device)


def attention_bias(mask: torch.Tensor, *, causal: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, L) bool real-item mask -> (B, 1, L, L) additive mask: 0 where `attention_allowed`, else -inf."""
    allowed = attention_allowed(mask, causal=causal).unsqueeze(1)  # (B, 1, L, L)
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))


class TransformerStack(nn.Module):
    """Blocks over ``{"hidden": (B, L, D), "mask": (B, L)}``; returns the state with "hidden" updated."""

    def __init__(
        self,
        dim: int,
        *,
        num_blocks: int,
        num_heads: int,
        ffn_dim: int,
        dropout: float,
        activation: str = "relu",
        norm_position: NormPosition = "post",
        norm_eps: float = 1e-5,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.blocks = nn.ModuleList(
            TransformerBlock(
                dim,
                num_heads,
                ffn_dim=ffn_dim,
                dropout=dropout,
                activation=activation,
                norm_position=norm_position,
                norm_eps=norm_eps,
            )
            for _ in range(num_blocks)
        )

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, mask = state["hidden"], state["mask"]  # (B, L, D), (B, L)
        bias = attention_bias(mask, causal=self.causal)  # (B, 1, L, L)
        keep = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
        for block in self.blocks:
            hidden = block(hidden, bias) * keep
        return {**state, "hidden": hidden}

    def block_parts(self) -> list[nn.Module]:
        """One ``state -> state`` module per block; their chain equals `forward` (`psrec.models.base.BlockStack`)."""
        return [BlockOnState(block, causal=self.causal) for block in self.blocks]  # type: ignore[arg-type]


class BlockOnState(nn.Module):
    """One `TransformerBlock` of a stack on the state dict (what `TransformerStack.forward` does per block)."""

    def __init__(self, block: TransformerBlock, *, causal: bool) -> None:
        super().__init__()
        self.block = block
        self.causal = causal

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, mask = state["hidden"], state["mask"]  # (B, L, D), (B, L)
        bias = attention_bias(mask, causal=self.causal)  # (B, 1, L, L)
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        return {**state, "hidden": self.block(hidden, bias) * keep}
