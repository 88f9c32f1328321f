"""What a psrec model receives: embeddings already looked up (on the parameter server) and dense features.

Models never own the big embedding tables: the trainer's client pulls rows from the PS (or a local
shard), pools them and hands the model a `ModelInput`. Gradients flow back into the pulled rows and
are pushed to the shards. Small dense parameters (positional embeddings, MLPs) live in the model.

The training contract every psrec model follows (`RecommendationModel`):

- ``uses_linear_terms: bool`` (class attribute): whether the trainer must fill ``ModelInput.linear``
  from the dim-1 companion table.
- ``forward(inp) -> logits``: CTR models return (B,) logits; SASRec and HSTU return (B, C) candidate
  logits.
- ``loss(inp, labels) -> (loss, scores)``: ``loss`` is the scalar mean training loss to backpropagate;
  ``scores`` are detached per-sample scores for running metrics. CTR models (and BST) use BCE with
  logits against ``labels`` (B,) in {0, 1} and return click probabilities (B,). Next-item
  models (SASRec, HSTU) ignore ``labels`` (pass None) and use their own next-item loss; their scores
  are (B, 2) logits ``[positive, negative]`` at the last position, i.e. a 2-candidate matrix with the
  target in column 0.
- ``predict(inp) -> scores`` (no grad bookkeeping; call under ``torch.no_grad()`` / ``eval()``): CTR
  models return probabilities (B,), next-item models candidate logits (B, C).

Sequence models (BST, SASRec, HSTU) also expose ``stages() -> ModelStages``: the embedding-side stage
(``ModelInput -> dict of tensors``), the block stack and the head (``dict -> dict``), whose
composition is exactly what ``forward`` runs, so that a pipeline can place them on different devices.
The block stack also offers ``block_parts()``: one ``dict -> dict`` module per block, whose chain
equals the stack (`BlockStack`), so that a pipeline can cut between blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as functional
from torch import nn


@dataclass
class ModelInput:
    dense: torch.Tensor  # (B, num_dense) float32; num_dense may be 0
    pooled: torch.Tensor  # (B, F, D) one pooled embedding per sparse feature, in schema order
    # (B, F) first-order (wide/linear) weight per sparse feature, pooled from a dim-1 companion table;
    # present only for models whose `uses_linear_terms` is True (LR, FM, Wide&Deep, DeepFM).
    linear: torch.Tensor | None = None
    # name -> (B, L, D) embedded sequence (left-padded) and (B, L) bool mask (True = real item)
    sequences: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> (B, L + 1) int64 event times (seconds) of a sequence's items, aligned with it (left-padded),
    # then the time of the event predicted after its last item; HSTU's time bias reads "seq" when given.
    timestamps: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> (B, L) int64 batch-local number of each item of a sequence (the same number in every
    # sequence of the same table = the same item; -1 at padding), set by the trainer: the sampled
    # softmax masks a negative that is the position's own next item ("accidental hit") with them.
    ids: dict[str, torch.Tensor] = field(default_factory=dict)


class RecommendationModel(Protocol):
    """What the trainer relies on; see the module docstring for the contract."""

    uses_linear_terms: bool

    def __call__(self, inp: ModelInput) -> torch.Tensor: ...

    def loss(self, inp: ModelInput, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def predict(self, inp: ModelInput) -> torch.Tensor: ...


class ClickThroughRateModel(nn.Module):
    """Base of the CTR models: subclasses implement ``forward(inp) -> (B,) logits``.

    Supplies the shared contract: BCE-with-logits loss and sigmoid probabilities.
    """

    uses_linear_terms: bool = False

    def loss(self, inp: ModelInput, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if labels is None:
            raise ValueError(f"{type(self).__name__}.loss needs labels (B,) in {{0, 1}}")
        logits = self(inp)  # (B,)
        loss = functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        return loss, torch.sigmoid(logits.detach())

    def predict(self, inp: ModelInput) -> torch.Tensor:
        return torch.sigmoid(self(inp))


class BlockStack(Protocol):
    """A model's block stack as a chain of per-block ``state -> state`` modules (see the docstring)."""

    def block_parts(self) -> list[nn.Module]: ...


class ModelStages(NamedTuple):
    """A sequence model split into stages; ``head(blocks(embedding(inp)))`` equals the model's forward."""

    embedding: nn.Module  # ModelInput -> dict[str, Tensor]
    blocks: nn.Module  # dict[str, Tensor] -> dict[str, Tensor]
    head: nn.Module  # dict[str, Tensor] -> dict[str, Tensor]


def require_linear(inp: ModelInput, model_name: str) -> torch.Tensor:
    """The (B, F) first-order weights, with a clear error when the trainer did not supply them."""
    if inp.linear is None:
        raise ValueError(f"{model_name} uses linear terms: ModelInput.linear (B, F) must be set")
    return inp.linear
