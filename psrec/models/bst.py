"""Behavior Sequence Transformer (BST, Chen et al. 2019, Alibaba) for CTR.

Math (B = batch, L = behaviour sequence length = ``max_length``, D = embedding dim, F = sparse features):

    s = [history (B, L, D), target (B, 1, D)] + P[-(L + 1):]          # learned positions, (B, L + 1, D)
    h = TransformerStack(s, key padding mask)                         # post-norm blocks, bidirectional
    z = [flatten(h * mask), flatten(pooled), dense]                   # (B, (L + 1) D + F D + num_dense)
    logit = MLP(z) -> (B,)                                            # LeakyReLU 1024-512-256 in the paper

The target item embedding is one of the pooled features (index ``target_feature_index``); the history
is ``ModelInput.sequences[sequence_name]`` with its mask (left-padded, most recent item last, so the
target sits right after the most recent item). Positions index from the right: the target always gets
the last positional vector. The paper's time-difference positions are replaced by learned ones. All
pooled features (the target included) also feed the MLP, as in FuxiCTR.

Stages (``stages()``): `BSTEmbedding` (ModelInput -> {"hidden", "mask", "context"}), the
`TransformerStack`, `BSTHead` (-> {"logits"}); ``forward`` is exactly their composition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from psrec.models.base import ClickThroughRateModel, ModelInput, ModelStages
from psrec.models.layers import MLP, flatten_features
from psrec.models.transformer import TransformerStack


class BSTEmbedding(nn.Module):
    """ModelInput -> {"hidden": (B, L + 1, D), "mask": (B, L + 1), "context": (B, F D + num_dense)}."""

    def __init__(
        self, embedding_dim: int, *, max_length: int, target_feature_index: int, sequence_name: str
    ) -> None:
        super().__init__()
        self.max_length = max_length
        self.target_feature_index = target_feature_index
        self.sequence_name = sequence_name
        self.positions = nn.Parameter(torch.randn(max_length + 1, embedding_dim) * 0.02)

    def forward(self, inp: ModelInput) -> dict[str, torch.Tensor]:
        if self.sequence_name not in inp.sequences or self.sequence_name not in inp.masks:
            raise ValueError(f"BST needs ModelInput.sequences/masks[{self.sequence_name!r}]")
        history = inp.sequences[self.sequence_name]  # (B, L, D)
        if history.shape[1] != self.max_length:
            raise ValueError(
                f"BST was built for sequences of length {self.max_length}, got {history.shape[1]}"
            )
        target = inp.pooled[:, self.target_feature_index].unsqueeze(1)  # (B, 1, D)
        tokens = torch.cat([history, target], dim=1) + self.positions  # (B, L + 1, D)
        real = inp.masks[self.sequence_name].bool()
        mask = torch.cat([real, torch.ones_like(real[:, :1])], dim=1)  # (B, L + 1)
        return {"hidden": tokens, "mask": mask, "context": flatten_features(inp.pooled, inp.dense)}


class BSTHead(nn.Module):
    """{"hidden", "mask", "context"} -> {"logits": (B,)}."""

    def __init__(
        self, input_dim: int, hidden_sizes: Sequence[int], *, activation: str, dropout: float
    ) -> None:
        super().__init__()
        self.mlp = MLP(input_dim, hidden_sizes, output_dim=1, activation=activation, dropout=dropout)

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = state["hidden"] * state["mask"].unsqueeze(-1).to(state["hidden"].dtype)  # (B, L + 1, D)
        features = torch.cat([hidden.flatten(1), state["context"]], dim=1)
        return {"logits": self.mlp(features).squeeze(-1)}


class BehaviorSequenceTransformer(ClickThroughRateModel):
    uses_linear_terms = False

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        *,
        target_feature_index: int,
        sequence_name: str = "history",
        max_length: int = 50,
        num_blocks: int = 1,
        num_heads: int = 1,
        dropout: float = 0.1,
        hidden_sizes: Sequence[int] = (1024, 512, 256),
    ) -> None:
        super().__init__()
        if not 0 <= target_feature_index < num_sparse:
            raise ValueError(f"target_feature_index {target_feature_index} not in [0, {num_sparse})")
        self.embedding = BSTEmbedding(
            embedding_dim,
            max_length=max_length,
            target_feature_index=target_feature_index,
            sequence_name=sequence_name,
        )
        self.blocks = TransformerStack(
            embedding_dim,
            num_blocks=num_blocks,
            num_heads=num_heads,
            ffn_dim=4 * embedding_dim,
            dropout=dropout,
            activation="leaky_relu",
            norm_position="post",
        )
        head_input = (max_length + 1) * embedding_dim + num_sparse * embedding_dim + num_dense
        self.head = BSTHead(head_input, hidden_sizes, activation="leaky_relu", dropout=dropout)

    def stages(self) -> ModelStages:
        return ModelStages(self.embedding, self.blocks, self.head)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        return self.head(self.blocks(self.embedding(inp)))["logits"]  # (B,)
