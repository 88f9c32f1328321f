"""`psrec.bench.hstu_reference_bench`: the gin reading, the batches both systems train on, psrec's pulled rows.

The last test runs one round of both systems on tiny batches (no timing checked) when a
generative-recommenders checkout and a Python for it are there (``PSREC_GR_REFERENCE_DIR``,
``PSREC_GR_REFERENCE_PYTHON``; by default /tmp/gr-ref and /tmp/torchrec-venv/bin/python), and skips
otherwise.

    pytest tests/bench/test_hstu_reference_bench.py
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from psrec.bench import hstu_reference_bench as bench
from psrec.data.sequences import InteractionData

GIN = """
# a comment
train_fn.main_module = "HSTU"
train_fn.loss_module = "SampledSoftmaxLoss"
train_fn.sampling_strategy = "local"
train_fn.user_embedding_norm = "l2_norm"
train_fn.item_l2_norm = True
train_fn.interaction_module_type = "DotProduct"
train_fn.max_sequence_length = 6
train_fn.local_batch_size = 3
train_fn.item_embedding_dim = 8
train_fn.dropout_rate = 0.1   # trailing comment
train_fn.num_negatives = 5
train_fn.temperature = 0.05
train_fn.learning_rate = 1e-3
train_fn.weight_decay = 0
train_fn.l2_norm_eps = 1e-6
hstu_encoder.num_blocks = 3
hstu_encoder.num_heads = 2
hstu_encoder.dqk = 4
hstu_encoder.dv = 4
hstu_encoder.linear_dropout_rate = 0.1
"""


def test_the_shape_is_read_from_the_gin_bindings() -> None:
    bindings = bench.read_gin_bindings(GIN)
    assert bindings["train_fn.item_l2_norm"] is True
    shape = bench.HSTUShape.from_bindings(bindings)
    assert (shape.num_blocks, shape.num_heads, shape.dqk, shape.dv) == (3, 2, 4, 4)
    assert (shape.max_length, shape.batch_size, shape.num_negatives, shape.dropout) == (6, 3, 5, 0.1)


def test_configs_psrec_cannot_match_are_refused() -> None:
    bindings = bench.read_gin_bindings(GIN)
    with pytest.raises(ValueError, match="loss_module"):
        bench.HSTUShape.from_bindings({**bindings, "train_fn.loss_module": "BCELoss"})
    with pytest.raises(ValueError, match="one dropout"):
        bench.HSTUShape.from_bindings({**bindings, "hstu_encoder.linear_dropout_rate": 0.0})
    with pytest.raises(ValueError, match="does not bind"):
        bench.HSTUShape.from_bindings({k: v for k, v in bindings.items() if k != "hstu_encoder.dqk"})
    with pytest.raises(ValueError, match="line 1"):
        bench.read_gin_bindings("train_fn.model = @HSTU")


def interactions(counts: list[int]) -> InteractionData:
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    items = np.concatenate([np.arange(1, count + 1) + 10 * user for user, count in enumerate(counts)])
    return InteractionData(np.arange(len(counts)), offsets, items.astype(np.int64), int(items.max()))


def test_batches_hold_each_users_last_items_and_psrec_reads_them_left_padded() -> None:
    data = interactions([1, 3, 9, 5, 7])  # user 0 has no position to train: never drawn
    batches = bench.make_batches(data, steps=4, batch_size=4, max_length=6, num_negatives=5, seed=0)
    assert batches.items.shape == (4, 4, 7) and batches.negatives.shape == (4, 4, 5)
    for step in range(4):
        for row in range(4):
            length = int(batches.lengths[step, row])
            user = (int(batches.items[step, row, 0]) - 1) // 10
            history = data.history(user)
            assert user != 0 and length == min(history.size - 1, 6)
            np.testing.assert_array_equal(batches.items[step, row, : length + 1], history[-(length + 1) :])
            assert not batches.items[step, row, length + 1 :].any()
            negatives = batches.negatives[step, row]  # uniform over all items, as the examples draw
            assert ((negatives >= 1) & (negatives <= data.num_items)).all()
        inputs, targets, mask = bench.left_padded(batches.items[step], batches.lengths[step], 6)
        np.testing.assert_array_equal(mask.sum(1), batches.lengths[step])
        for row in range(4):
            length = int(batches.lengths[step, row])
            np.testing.assert_array_equal(inputs[row, 6 - length :], batches.items[step, row, :length])
            np.testing.assert_array_equal(
                targets[row, 6 - length :], batches.items[step, row, 1 : length + 1]
            )
            assert not inputs[row, : 6 - length].any() and not targets[row, : 6 - length].any()


def test_pulled_input_gathers_the_table_rows_and_numbers_them() -> None:
    table = torch.randn(50, 4)
    data = interactions([4, 6, 9])
    batches = bench.make_batches(data, steps=1, batch_size=3, max_length=5, num_negatives=3, seed=1)
    inputs, targets, mask = bench.left_padded(batches.items[0], batches.lengths[0], 5)
    inp, rows, table_rows = bench.pulled_input(table, inputs, targets, mask, batches.negatives[0])
    assert rows.requires_grad and rows.is_leaf
    mask_t = torch.from_numpy(mask)
    for name, ids in (("seq", inputs), ("pos", targets)):
        expected = table[torch.from_numpy(np.maximum(ids, 1) - 1)] * mask_t.unsqueeze(-1)
        torch.testing.assert_close(inp.sequences[name], expected)
    torch.testing.assert_close(inp.sequences["negatives"], table[torch.from_numpy(batches.negatives[0] - 1)])
    pos_ids, negative_ids = inp.ids["pos"], inp.ids["negatives"]
    assert bool((pos_ids[~mask_t] == -1).all())
    torch.testing.assert_close(table_rows[pos_ids[mask_t]], torch.from_numpy(targets[mask] - 1))
    torch.testing.assert_close(table_rows[negative_ids], torch.from_numpy(batches.negatives[0] - 1))


REFERENCE_DIR = Path(os.environ.get("PSREC_GR_REFERENCE_DIR", "/tmp/gr-ref"))
REFERENCE_PYTHON = os.environ.get("PSREC_GR_REFERENCE_PYTHON", "/tmp/torchrec-venv/bin/python")


@pytest.mark.skipif(
    not (REFERENCE_DIR / bench.CONFIGS["regular"]).is_file() or not Path(REFERENCE_PYTHON).is_file(),
    reason="no generative-recommenders checkout or no Python for it",
)
def test_one_round_of_both_systems_trains_the_same_tokens_with_matching_blocks(tmp_path: Path) -> None:
    probe = [REFERENCE_PYTHON, "-c", "import torch, fbgemm_gpu, gin"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        pytest.skip(f"{REFERENCE_PYTHON} lacks torch, fbgemm_gpu or gin-config")
    gin_file = REFERENCE_DIR / bench.CONFIGS["regular"]
    shape = replace(
        bench.HSTUShape.from_bindings(bench.read_gin_bindings(gin_file.read_text())), batch_size=4
    )
    data = interactions([30, 12, 250, 7, 40])
    batches = bench.make_batches(
        data, steps=2, batch_size=4, max_length=shape.max_length, num_negatives=128, seed=0
    )
    batches.save(tmp_path / "batches.npz")
    request = {
        "config": asdict(shape),
        "num_items": data.num_items,
        "batches": str(tmp_path / "batches.npz"),
        "warmup": 1,
        "threads": 1,
        "seed": 0,
        "negatives_per": "user",
        "bias": "position",
        "reference_dir": str(REFERENCE_DIR.resolve()),
        "gin_file": str(gin_file.resolve()),
    }
    result = bench.run_round(request, reference_python=REFERENCE_PYTHON, workdir=tmp_path, timeout=600)
    psrec, reference = result["psrec"], result["reference"]
    assert psrec["tokens"] == reference["tokens"] == int(batches.lengths[1].sum())
    assert all(np.isfinite(psrec["losses"])) and all(np.isfinite(reference["losses"]))
    assert psrec["parameters"]["projections"] == reference["parameters"]["projections"]
    dim = shape.item_embedding_dim
    assert psrec["parameters"]["items"] == data.num_items * dim  # no padding row
    assert reference["parameters"]["items"] == (data.num_items + 1) * dim
    assert reference["parameters"]["positions"] == (shape.max_length + 11) * dim
