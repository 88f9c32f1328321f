"""The reference side of `psrec.bench.hstu_reference_bench`: generative-recommenders' HSTU trained on the bench's batches.

A standalone script for the reference's Python (it imports NumPy, torch, fbgemm_gpu, gin and the
reference, never psrec)::

    REFERENCE_PYTHON psrec/bench/hstu_reference_worker.py REQUEST.json RESULT.json

REQUEST (written by the bench) names the reference's source tree (``reference_dir``, a checkout of
facebookresearch/generative-recommenders, put first on ``sys.path``; the script fails if
``generative_recommenders`` is imported from anywhere else), its gin file, the batches (`.npz`) and
the settings; RESULT gets the timings, the parameter counts and the versions.

The model and the step are the reference's own, built as ``research/trainer/train.py`` (``train_fn``)
builds them: ``LocalEmbeddingModule`` (an ``nn.Embedding`` of ``num_items + 1`` rows, row 0 the
padding), ``LearnablePositionalEmbeddingInputFeaturesPreprocessor`` (``max_length + 11`` positions),
the HSTU encoder from ``get_sequential_encoder`` with the blocks, heads, dqk, dv and linear dropout
the gin file binds to ``hstu_encoder`` (parsed here with ``skip_unknown``), ``L2NormEmbeddingPostprocessor``,
``DotProductSimilarity``, ``LocalNegativesSampler`` (L2-normalised, ``num_negatives`` uniform draws
per position) and ``SampledSoftmaxLoss``; AdamW (betas 0.9, 0.98, the gin file's lr and weight decay)
over every parameter, the item table included. One step is train_fn's loop body: the ids padded to
``max_length + 11`` columns with the target at column ``length``, item lookup, encoder, the loss of
positions ``0 .. length - 1`` against items ``1 .. length``, backward, optimizer step. Left out: DDP
(one process), the TensorBoard writes and ``torch.autograd.set_detect_anomaly(True)``, which
train_fn turns on for the whole run and which slows every step.

CPU paths: research/modeling/sequential/hstu.py is plain PyTorch (einsums over the padded batch)
around fbgemm_gpu's jagged operators (``jagged_to_padded_dense``, ``dense_to_jagged``,
``asynchronous_complete_cumsum``), which run as fbgemm_gpu-cpu's CPU kernels; no Triton kernel is
on this path (those serve the repository's newer ``generative_recommenders/ops`` models).

The relative attention bias runs only when the batch has timestamps (``past_payloads["timestamps"]``).
The batches have none, so the script passes zeros and, for ``"bias": "position"``, replaces each
block's ``RelativeBucketedTimeAndPositionBasedBias`` by the reference's ``RelativePositionalBias``
(2n - 1 weights by signed distance, n = ``max_length + 11``); ``"time-and-position"`` keeps the
bucketed time bias, on all-zero gaps: the cost of the reference's own ML-1M run, whose data has times.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

GR_OUTPUT_LENGTH = 10  # train_fn's default gr_output_length: the ids are padded by 10 + 1 columns
BETAS = (0.9, 0.98)  # train_fn's AdamW


def import_reference(reference_dir: str) -> dict[str, Any]:
    """The reference's classes, imported from `reference_dir` only."""
    sys.path.insert(0, reference_dir)
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm's CPU kernels, as the reference's main.py
    import gin
    from generative_recommenders.research.modeling import similarity_utils
    from generative_recommenders.research.modeling.sequential import (
        autoregressive_losses,
        embedding_modules,
        encoder_utils,
        hstu,
        input_features_preprocessors,
        output_postprocessors,
    )
    from generative_recommenders.research.modeling.sequential.losses import sampled_softmax

    source = Path(hstu.__file__).resolve()
    if Path(reference_dir).resolve() not in source.parents:
        raise RuntimeError(f"the reference was imported from {source}, not from {reference_dir}")
    return {
        "gin": gin,
        "fbgemm_version": getattr(fbgemm_gpu, "__version__", "unknown"),
        "LocalEmbeddingModule": embedding_modules.LocalEmbeddingModule,
        "get_similarity_function": similarity_utils.get_similarity_function,
        "L2NormEmbeddingPostprocessor": output_postprocessors.L2NormEmbeddingPostprocessor,
        "Preprocessor": input_features_preprocessors.LearnablePositionalEmbeddingInputFeaturesPreprocessor,
        "get_sequential_encoder": encoder_utils.get_sequential_encoder,
        "RelativePositionalBias": hstu.RelativePositionalBias,
        "LocalNegativesSampler": autoregressive_losses.LocalNegativesSampler,
        "SampledSoftmaxLoss": sampled_softmax.SampledSoftmaxLoss,
    }


def parameter_groups(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts by the bench's groups (items, positions, projections, position/time bias)."""
    groups = {"items": 0, "positions": 0, "projections": 0, "position bias": 0, "time bias": 0}
    for name, parameter in model.named_parameters():
        if "_item_emb" in name:
            group = "items"
        elif "_pos_emb" in name:
            group = "positions"
        elif "_ts_w" in name:
            group = "time bias"
        elif "_rel_attn_bias" in name:
            group = "position bias"
        else:
            group = "projections"  # _uvqk, _o.weight, _o.bias
        groups[group] += parameter.numel()
    return groups


def run(request: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(request["threads"])
    reference = import_reference(request["reference_dir"])
    reference["gin"].parse_config_file(request["gin_file"], skip_unknown=True)  # binds hstu_encoder.*
    config = request["config"]
    dim, max_length, num_items = config["item_embedding_dim"], config["max_length"], request["num_items"]
    torch.manual_seed(request["seed"])
    embedding_module = reference["LocalEmbeddingModule"](num_items=num_items, item_embedding_dim=dim)
    interaction_module, _ = reference["get_similarity_function"](
        module_type="DotProduct", query_embedding_dim=dim, item_embedding_dim=dim
    )
    padded_length = max_length + GR_OUTPUT_LENGTH + 1
    model = reference["get_sequential_encoder"](
        module_type="HSTU",
        max_sequence_length=max_length,
        max_output_length=GR_OUTPUT_LENGTH + 1,
        embedding_module=embedding_module,
        interaction_module=interaction_module,
        input_preproc_module=reference["Preprocessor"](
            max_sequence_len=padded_length, embedding_dim=dim, dropout_rate=config["dropout"]
        ),
        output_postproc_module=reference["L2NormEmbeddingPostprocessor"](embedding_dim=dim, eps=1e-6),
        verbose=False,
    )
    if request["bias"] == "position":
        for layer in model._hstu._attention_layers:
            layer._rel_attn_bias = reference["RelativePositionalBias"](max_seq_len=padded_length)
    sampler = reference["LocalNegativesSampler"](
        num_items=num_items,
        item_emb=model._embedding_module._item_emb,
        all_item_ids=list(range(1, num_items + 1)),
        l2_norm=True,
        l2_norm_eps=config["l2_norm_eps"],
    )
    loss_module = reference["SampledSoftmaxLoss"](
        num_to_sample=config["num_negatives"], softmax_temperature=config["temperature"], model=model
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config["learning_rate"], betas=BETAS, weight_decay=config["weight_decay"]
    )
    model.train()

    arrays = np.load(request["batches"])
    items, lengths = arrays["items"], arrays["lengths"]  # (S, B, L + 1) oldest first, zeros after; (S, B)
    batches = []
    for step in range(items.shape[0]):
        past_ids = np.zeros((items.shape[1], padded_length), dtype=np.int64)
        past_ids[:, : max_length + 1] = items[step]  # history, then the target at column `length`
        batches.append(
            (
                torch.from_numpy(past_ids),
                torch.from_numpy(lengths[step].astype(np.int64)),
                {"timestamps": torch.zeros(past_ids.shape, dtype=torch.int64)},
            )
        )

    def one_step(
        past_ids: torch.Tensor, past_lengths: torch.Tensor, payloads: dict[str, torch.Tensor]
    ) -> float:
        optimizer.zero_grad()
        input_embeddings = model.get_item_embeddings(past_ids)  # (B, n, D)
        seq_embeddings = model(
            past_lengths=past_lengths,
            past_ids=past_ids,
            past_embeddings=input_embeddings,
            past_payloads=payloads,
        )  # (B, n, D)
        sampler._item_emb = model._embedding_module._item_emb
        supervision_weights = (past_ids[:, 1:] != 0).float()
        loss, _ = loss_module(
            lengths=past_lengths,
            output_embeddings=seq_embeddings[:, :-1, :],
            supervision_ids=past_ids[:, 1:],
            supervision_embeddings=input_embeddings[:, 1:, :],
            supervision_weights=supervision_weights,
            negatives_sampler=sampler,
            **payloads,
        )
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    warmup = request["warmup"]
    losses = [one_step(*batch) for batch in batches[:warmup]]
    start, cpu_start = time.perf_counter(), time.process_time()
    losses += [one_step(*batch) for batch in batches[warmup:]]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "steps": len(batches) - warmup,
        "tokens": int(lengths[warmup:].sum()),
        "losses": losses,
        "parameters": parameter_groups(model),
        "torch": torch.__version__,
        "fbgemm_gpu": reference["fbgemm_version"],
        "threads": torch.get_num_threads(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    request_path, result_path = sys.argv[1], sys.argv[2]
    result = run(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
