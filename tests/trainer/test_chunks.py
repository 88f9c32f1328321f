"""A chunk's running metrics from its steps' results.

pytest tests/trainer/test_chunks.py
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from psrec.trainer.chunks import ChunkSoFar
from psrec.trainer.step import StepResult


def test_ranking_scores_are_sigmoids_even_of_a_masked_negatives_lowest_logit() -> None:
    """Oracle: torch.sigmoid. A sampled-softmax negative that is the position's own target carries
    the dtype's lowest logit (psrec.models.sasrec.negatives_logits); its score is 0, with no warning."""
    logits = np.array([[3.0, torch.finfo(torch.float32).min], [-20.0, 90.0], [0.0, -1.5]], dtype=np.float32)
    chunk = ChunkSoFar()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk.record(
            StepResult(step=0, loss=1.0, scores=logits, labels=np.zeros(3, np.float32), row_ids=None)
        )
    np.testing.assert_allclose(
        chunk.scores[0], torch.sigmoid(torch.from_numpy(logits).reshape(-1)).numpy(), rtol=1e-6
    )
    np.testing.assert_array_equal(chunk.labels[0], [1, 0, 1, 0, 1, 0])
