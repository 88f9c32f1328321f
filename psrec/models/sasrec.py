"""SASRec (Kang & McAuley 2018): next-item prediction with causal self-attention.

Math (B = batch, L = sequence length <= ``max_length``, D = embedding dim):

    x = Dropout(E[seq] * sqrt(D) + P[-L:]) * mask               # (B, L, D), learned positions
    h = LN(TransformerStack_causal(x))                          # "pre" blocks, zeroed at padding
    r_t = <h_t, E[i]>                                           # relevance of item i after step t
    (``similarity="cosine"``, generative-recommenders' variant: h = TransformerStack_causal(x) with no
    final LN, r_t = <h_t / ||h_t||, E[i] / ||E[i]||> / temperature)

Layer norms use eps 1e-8, and the weights start as in the reference PyTorch code
(pmixer/SASRec.pytorch): Xavier-normal positions and weights (the query/key/value projections drawn
as one (3D, D) in-projection, as ``nn.MultiheadAttention``), zero attention biases, PyTorch's
default feed-forward biases. The item table lives on the parameter server, so its initializer and
optimizer come from the embedding config; on short histories they decide the result. The reference
starts it Xavier-normal (``std = sqrt(2 / (num_items + 1 + D))``, 0.0128 on Amazon Beauty) and steps
it with dense Adam (``optimizer.lazy: false``: rows not in the batch keep moving with their
moments); see examples/beauty_sasrec.yaml and docs/results.md. Padded keys are masked (the
reference attends them; on Beauty that changes nothing measurable).

Inputs (``ModelInput.sequences``, all pulled from the same item table):

- ``"seq"`` (B, L, D) with ``masks["seq"]`` (B, L) bool: the left-padded history, most recent last.
- training: ``"pos"`` (B, L, D), the next item at each position, and the negatives of the loss:

  - ``loss="bce"`` (the reference code's): ``"neg"`` (B, L, D), one sampled negative per position;
    ``mean BCE(r_pos, 1) + mean BCE(r_neg, 0)``.
  - ``loss="sampled_softmax"``: ``"negatives"`` (B, N, D), N sampled items per user shared by its
    positions; cross-entropy of the next item among itself and the N:
    ``mean(logsumexp([r_pos, r_neg_1 .. r_neg_N]) - r_pos)`` (`sampled_softmax_loss`). The
    negatives are drawn uniformly (psrec's interactions reader), so there is no popularity bias to
    correct; the logQ correction would subtract the same constant log(N / num_items) from every
    negative logit (which turns the loss into an estimate of the full softmax), and is left out, as
    is usual for uniform negatives.

  Means over real positions, ``masks["pos"]`` when given, else ``masks["seq"]``.
- evaluation: ``"candidates"``, (B, C, D) per user (sampled protocol: target first) or (N, D) or
  (1, N, D) shared by the batch (full ranking), scored against the last position: ``forward -> (B, C)``
  or ``(B, N)``.

Stages (``stages()``): `SASRecEmbedding` (ModelInput -> {"hidden", "mask", and pass-through "pos",
"neg", "negatives", "candidates"}), the `TransformerStack`, `SASRecHead` (final layer norm and the dot products ->
{"hidden", "pos_logits", "neg_logits", "negatives_logits" (B, L, N), "candidate_logits"} for whatever
inputs were given).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as functional
from torch import nn

from psrec.models.base import ModelInput, ModelStages
from psrec.models.pooled_negatives import pooled_negatives_logits
from psrec.models.transformer import Dropout, TransformerBlock, TransformerStack

TARGET_SEQUENCES = ("pos", "neg", "negatives", "candidates")
HIT_IDS = ("pos", "negatives")  # sequences whose `ModelInput.ids` pass to the head as "<name>_ids"
Loss = Literal["bce", "sampled_softmax"]
NORM_EPS = 1e-8
L2_NORM_EPS = 1e-6  # generative-recommenders' l2_norm_eps
Similarity = Literal["dot", "cosine"]


class SASRecEmbedding(nn.Module):
    """ModelInput -> {"hidden": (B, L, D), "mask": (B, L), pass-through pos/neg/candidates}."""

    def __init__(self, embedding_dim: int, *, max_length: int, dropout: float) -> None:
        super().__init__()
        self.max_length = max_length
        self.scale = math.sqrt(embedding_dim)
        self.positions = nn.Parameter(nn.init.xavier_normal_(torch.empty(max_length, embedding_dim)))
        self.dropout = Dropout(dropout)

    def forward(self, inp: ModelInput) -> dict[str, torch.Tensor]:
        if "seq" not in inp.sequences or "seq" not in inp.masks:
            raise ValueError('SASRec needs ModelInput.sequences["seq"] and masks["seq"]')
        sequence = inp.sequences["seq"]  # (B, L, D)
        length = sequence.shape[1]
        if length > self.max_length:
            raise ValueError(f"SASRec was built for sequences up to {self.max_length} long, got {length}")
        mask = inp.masks["seq"].bool()  # (B, L)
        hidden = self.dropout(sequence * self.scale + self.positions[self.max_length - length :])
        hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
        state = {"hidden": hidden, "mask": mask}
        state.update(target_state(inp))
        return state


class SASRecHead(nn.Module):
    """The user state, then its scores against whichever of pos/neg/negatives/candidates the state carries.

    ``similarity="dot"`` (the SASRec paper's): a final layer norm, then dot products.
    ``similarity="cosine"`` (generative-recommenders' SASRec): no final norm; the L2-normalised state
    against L2-normalised items, divided by ``temperature``.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        negatives_per: NegativesPer = "user",
        similarity: Similarity = "dot",
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embedding_dim, eps=NORM_EPS) if similarity == "dot" else None
        self.negatives_per = negatives_per
        self.temperature = temperature

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.norm is not None:
            hidden = self.norm(state["hidden"])  # (B, L, D)
            scaled, items = hidden, (lambda x: x)
        else:
            hidden = l2_normalize(state["hidden"])
            scaled, items = hidden / self.temperature, l2_normalize
        out = {"hidden": hidden}
        if "pos" in state:
            out["pos_logits"] = (scaled * items(state["pos"])).sum(-1)  # (B, L)
        if "neg" in state:
            out["neg_logits"] = (scaled * items(state["neg"])).sum(-1)  # (B, L)
        if "negatives" in state:
            out["negatives_logits"] = negatives_logits(
                scaled, items(state["negatives"]), self.negatives_per, hit_ids(state), state.get("mask")
            )
        if "candidates" in state:
            out["candidate_logits"] = candidate_logits(scaled, items(state["candidates"]))
        return out


class SASRec(nn.Module):
    uses_linear_terms = False

    def __init__(
        self,
        embedding_dim: int,
        *,
        max_length: int = 200,
        num_blocks: int = 2,
        num_heads: int = 1,
        dropout: float = 0.2,
        loss: Loss = "bce",
        negatives_per: NegativesPer = "user",
        similarity: Similarity = "dot",
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if loss not in ("bce", "sampled_softmax"):
            raise ValueError(f"SASRec loss must be 'bce' or 'sampled_softmax', not {loss!r}")
        if similarity not in ("dot", "cosine"):
            raise ValueError(f"SASRec similarity must be 'dot' or 'cosine', not {similarity!r}")
        if temperature <= 0:
            raise ValueError(f"SASRec temperature must be > 0, got {temperature}")
        check_negatives_per(negatives_per)
        self.loss_name = loss
        self.embedding = SASRecEmbedding(embedding_dim, max_length=max_length, dropout=dropout)
        self.blocks = TransformerStack(
            embedding_dim,
            num_blocks=num_blocks,
            num_heads=num_heads,
            ffn_dim=embedding_dim,
            dropout=dropout,
            activation="relu",
            norm_position="pre",
            norm_eps=NORM_EPS,
            causal=True,
        )
        self.head = SASRecHead(
            embedding_dim, negatives_per=negatives_per, similarity=similarity, temperature=temperature
        )
        self._initialise_blocks()

    def _initialise_blocks(self) -> None:
        """The reference code's init (see the module docstring); positions are drawn in SASRecEmbedding."""
        with torch.no_grad():
            for block in self.blocks.blocks:
                assert isinstance(block, TransformerBlock)
                attention = block.attention
                projections = (attention.query, attention.key, attention.value)
                dim = attention.query.in_features
                joint = nn.init.xavier_normal_(torch.empty(3 * dim, dim))  # (3D, D) in-projection
                for projection, weight in zip(projections, joint.chunk(3), strict=True):
                    projection.weight.copy_(weight)
                    nn.init.zeros_(projection.bias)
                nn.init.xavier_normal_(attention.output.weight)
                nn.init.zeros_(attention.output.bias)
                for layer in block.ffn.layers:
                    if isinstance(layer, nn.Linear):
                        nn.init.xavier_normal_(layer.weight)

    def stages(self) -> ModelStages:
        return ModelStages(self.embedding, self.blocks, self.head)

    def run(self, inp: ModelInput) -> dict[str, torch.Tensor]:
        """All head outputs for the given inputs: the composition of the three stages."""
        return self.head(self.blocks(self.embedding(inp)))

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Candidate logits (B, C) (or (B, N) for shared candidates) from the last position."""
        if "candidates" not in inp.sequences:
            raise ValueError('SASRec.forward scores ModelInput.sequences["candidates"]; none given')
        return self.run(inp)["candidate_logits"]

    def loss(self, inp: ModelInput, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss over real positions, (B, 2) [pos, a negative] logits at the last position).

        `labels` is ignored: the targets are the next items ("pos") and sampled negatives ("neg" for
        BCE, "negatives" for the sampled softmax; see the module docstring).
        """
        check_next_item_inputs(inp, self.loss_name, "SASRec")
        return next_item_loss(self.run(inp), inp, self.loss_name)

    def predict(self, inp: ModelInput) -> torch.Tensor:
        return self(inp)


def candidate_logits(hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Scores of candidate items after the most recent position of `hidden` (B, L, D): candidates
    (B, C, D) per user -> (B, C), or (N, D) / (1, N, D) shared by the batch -> (B, N)."""
    last = hidden[:, -1]  # (B, D): the most recent position (sequences are left-padded)
    if candidates.ndim == 3 and candidates.shape[0] == 1:
        candidates = candidates[0]
    if candidates.ndim == 2:
        return last @ candidates.T  # (B, N)
    return torch.einsum("bd,bcd->bc", last, candidates)  # (B, C)


NegativesPer = Literal["user", "position"]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-6) over the last dimension (generative-recommenders' L2 norm, eps-clamped)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=L2_NORM_EPS)


def target_state(inp: ModelInput) -> dict[str, torch.Tensor]:
    """What an embedding stage passes through to the head: the target sequences ("pos", "neg",
    "negatives", "candidates") and, where the trainer numbered them, "pos_ids" and "negatives_ids"."""
    state = {name: inp.sequences[name] for name in TARGET_SEQUENCES if name in inp.sequences}
    state.update({f"{name}_ids": inp.ids[name] for name in HIT_IDS if name in inp.ids})
    return state


def hit_ids(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pos ids (B, L), negatives ids (B, N)) when the state carries both, else None."""
    if "pos_ids" in state and "negatives_ids" in state:
        return state["pos_ids"], state["negatives_ids"]
    return None


def negatives_logits(
    hidden: torch.Tensor,
    negatives: torch.Tensor,
    per: NegativesPer,
    ids: tuple[torch.Tensor, torch.Tensor] | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, L, N) logits of each position's sampled-softmax negatives.

    hidden (B, L, D) and negatives (B, N, D), the N items drawn for each user of the batch.
    ``per="user"``: every position of a sequence scores its own user's N draws. ``per="position"``:
    every position scores its own N, each picked uniformly (torch's generator, as dropout) from the
    batch's B * N draws, as the reference draws N per position (psrec/models/pooled_negatives.py);
    positions where `real` (B, L) is False get logits of 0.

    With `ids` ((B, L) numbers of each position's next item, (B, N) of the draws; `ModelInput.ids`),
    a draw that is the position's own next item (an accidental hit) gets the dtype's lowest logit:
    it drops out of the softmax and gets no gradient, as the reference masks it.
    """
    if per == "user":
        logits = hidden @ negatives.transpose(1, 2)
        return logits if ids is None else _mask_hits(logits, ids[0], ids[1])
    batch, length, dim = hidden.shape
    count = negatives.shape[1]
    picks = torch.randint(0, batch * count, (batch * length, count), device=hidden.device)
    targets, pool_ids = (None, None) if ids is None else (ids[0].reshape(-1), ids[1].reshape(-1))
    if real is None:
        real = torch.ones(batch, length, dtype=torch.bool, device=hidden.device)
    logits = pooled_negatives_logits(
        hidden.reshape(batch * length, dim),
        negatives.reshape(batch * count, dim),
        picks,
        real=real.reshape(-1),
        targets=targets,
        pool_ids=pool_ids,
    )
    return logits.view(batch, length, count)


def _mask_hits(logits: torch.Tensor, pos_ids: torch.Tensor, negatives_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, L, N) with the lowest value where group b's draw n is position (b, l)'s next item."""
    hits = pos_ids.unsqueeze(-1) == negatives_ids.unsqueeze(1)  # (B, L, N)
    return logits.masked_fill(hits, torch.finfo(logits.dtype).min)


def check_negatives_per(per: str) -> None:
    if per not in ("user", "position"):
        raise ValueError(f"negatives_per must be 'user' or 'position', not {per!r}")


def check_next_item_inputs(inp: ModelInput, loss_name: Loss, model: str) -> None:
    """The targets a next-item loss needs are in `inp`: "pos" and "neg" (bce) or "negatives"."""
    negatives = "neg" if loss_name == "bce" else "negatives"
    if "pos" not in inp.sequences or negatives not in inp.sequences:
        raise ValueError(f'{model}.loss ({loss_name}) needs ModelInput.sequences["pos"] and ["{negatives}"]')


def next_item_loss(
    out: dict[str, torch.Tensor], inp: ModelInput, loss_name: Loss
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-item loss over real positions of a head's output (``pos_logits`` and
    ``negatives_logits`` (B, L, N) or ``neg_logits`` (B, L)), and the (B, 2) [positive, a negative]
    logits at the last position (the running metrics' scores); SASRec's and HSTU's."""
    real = inp.masks.get("pos", inp.masks["seq"]).bool()  # (B, L)
    positive = out["pos_logits"]
    if loss_name == "sampled_softmax":
        negative = out["negatives_logits"]  # (B, L, N)
        loss = sampled_softmax_loss(positive[real], negative[real])
        last_negative = negative[:, -1, 0]
    else:
        negative = out["neg_logits"]  # (B, L)
        loss = functional.binary_cross_entropy_with_logits(
            positive[real], torch.ones_like(positive[real])
        ) + functional.binary_cross_entropy_with_logits(negative[real], torch.zeros_like(negative[real]))
        last_negative = negative[:, -1]
    scores = torch.stack([positive[:, -1], last_negative], dim=1).detach()
    return loss, scores


def sampled_softmax_loss(
    positive: torch.Tensor, negatives: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean"
) -> torch.Tensor:
    """Mean (or summed) cross-entropy of each target among itself and its sampled negatives.

    positive (R,) and negatives (R, N) logits of R real positions: ``mean(logsumexp([p, n]) - p)``.
    """
    logits = torch.cat([positive.unsqueeze(-1), negatives], dim=-1)  # (R, 1 + N)
    losses = torch.logsumexp(logits, dim=-1) - positive  # (R,)
    return losses.sum() if reduction == "sum" else losses.mean()
