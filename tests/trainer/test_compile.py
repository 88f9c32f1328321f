"""`training.compile`: the compiled dense model trains like the eager one and keeps its state_dict keys.

One test, in the slow tier (``training.compile`` is off by default, and compiling even the tiny DLRM
takes most of a minute on a cold inductor cache): ``python -m pytest tests/trainer/test_compile.py -m slow -q``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config


def _run(sources: dict[str, Any], run_dir: Path, *, compiled: bool) -> dict[str, Any]:
    """Every step's mean loss over one epoch (batch 4096: 5 full batches, then one of 3520 rows),
    the validation scores, and the dense state."""
    config = small_run_config(sources, run_dir, **{"training.compile": compiled, "training.batch_size": 4096})
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        runtime.start_epoch(0)
        losses, sizes = [], []
        while True:
            (chunk,) = runtime.train_steps(1)
            if chunk.steps == 0:
                break
            losses.append(chunk.loss_sum / chunk.samples)
            sizes.append(chunk.samples)
        return {
            "losses": np.array(losses),
            "sizes": sizes,
            "scores": runtime.evaluate("validation")["scores"],
            "dense": runtime.dense_states()[0],
        }
    finally:
        runtime.shutdown()


# Importing inductor defines torch.utils.mkldnn's TorchScript modules, which warn on torch 2.13.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
def test_compiled_training_matches_eager(synthetic_sources: dict[str, Any], tmp_path: Path) -> None:
    eager = _run(synthetic_sources, tmp_path / "eager", compiled=False)
    graphs = counters["stats"]["unique_graphs"]
    compiled = _run(synthetic_sources, tmp_path / "compiled", compiled=True)
    assert counters["stats"]["unique_graphs"] - graphs >= 2  # loss and predict really ran compiled
    # The last, smaller batch recompiles (dynamic batch dimension) instead of failing.
    assert compiled["sizes"] == eager["sizes"] == [4096] * 5 + [3520]
    # Same trajectory up to float reassociation in the fused kernels.
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(compiled["scores"], eager["scores"], rtol=1e-3, atol=1e-4)
    # Checkpoints save model.state_dict(): the keys must not gain torch.compile's `_orig_mod.` prefix.
    assert list(compiled["dense"]) == list(eager["dense"])
    for name, value in eager["dense"].items():
        torch.testing.assert_close(compiled["dense"][name], value, rtol=1e-3, atol=1e-4)
