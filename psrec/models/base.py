"""What a psrec model receives: embeddings already looked up (on the parameter server) and dense features.

Models never own the big embedding tables: the trainer's client pulls rows from the PS (or a local
shard), pools them and hands the model a `ModelInput`. Gradients flow back into the pulled rows and
are pushed to the shards. Small dense parameters (positional embeddings, MLPs) live in the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
