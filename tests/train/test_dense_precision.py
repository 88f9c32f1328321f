"""`training.dense_precision` end to end: what `auto` resolves to on a CPU with and without native
bf16, what the model then computes in, what `summary.json` says, and a resume across precisions.

The CPU's features come from ``PSREC_ISA_FEATURES`` (set per test; the suite pins it, tests/conftest.py),
so nothing here depends on this machine's CPU. What the model computed in is observed, not reported:
a forward hook on every ``nn.Linear`` records the dtype of its output (bf16 under bf16 autocast).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from psrec.machine import FEATURES_VARIABLE
from psrec.train.loop import train
from tests.conftest import small_run_config

NO_BF16 = "avx2,avx512f,avx512_vnni"  # an Intel Xeon without avx512_bf16 or AMX
ZEN4 = "avx2,avx512f,avx512_bf16,avx512_vnni"  # an AMD EPYC with avx512_bf16
STEPS = {"training.max_steps": 2, "training.log_every_steps": 1}


@pytest.fixture
def linear_dtypes() -> Iterator[set[torch.dtype]]:
    """The dtypes of every nn.Linear output computed while the test runs (all models, all threads)."""
    seen: set[torch.dtype] = set()

    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("features", "resolved", "dtype"),
    [(NO_BF16, "fp32", torch.float32), (ZEN4, "bf16", torch.bfloat16)],
    ids=["intel-no-bf16", "amd-zen4"],
)
def test_auto_follows_the_cpu_and_the_summary_names_it(
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    linear_dtypes: set[torch.dtype],
    features: str,
    resolved: str,
    dtype: torch.dtype,
) -> None:
    monkeypatch.setenv(FEATURES_VARIABLE, features)
    config = small_run_config(synthetic_sources, tmp_path, **STEPS)
    assert config.training.dense_precision == "auto"
    train(config)
    assert linear_dtypes == {dtype}  # training and evaluation computed in the resolved precision
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dense_precision"]["setting"] == "auto"
    assert summary["dense_precision"]["resolved"] == resolved
    assert ("natively" in summary["dense_precision"]["reason"]) == (resolved == "bf16")
    machine = summary["machine"]
    assert machine["isa_features"] == features.split(",")
    assert machine["isa_features_from"] == FEATURES_VARIABLE
    assert machine["cpu_model"] and machine["cores"] >= 1
    assert "trainer_machines" not in summary  # one trainer


def test_explicit_bf16_without_native_bf16_trains_in_bf16_and_warns(
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    linear_dtypes: set[torch.dtype],
) -> None:
    monkeypatch.setenv(FEATURES_VARIABLE, NO_BF16)
    config = small_run_config(synthetic_sources, tmp_path, **STEPS, **{"training.dense_precision": "bf16"})
    with caplog.at_level(logging.WARNING, logger="psrec.trainer.worker"):
        summary = train(config)
    assert linear_dtypes == {torch.bfloat16}
    assert summary["dense_precision"]["resolved"] == "bf16"
    warnings = [r.getMessage() for r in caplog.records if r.name == "psrec.trainer.worker"]
    assert any("0.38-0.39x" in message and "auto or fp32" in message for message in warnings), warnings
    assert "0.38-0.39x" in summary["dense_precision"]["warning"]


def test_explicit_fp32_on_a_bf16_cpu_stays_fp32(
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    linear_dtypes: set[torch.dtype],
) -> None:
    monkeypatch.setenv(FEATURES_VARIABLE, ZEN4)
    config = small_run_config(synthetic_sources, tmp_path, **STEPS, **{"training.dense_precision": "fp32"})
    assert train(config)["dense_precision"]["resolved"] == "fp32"
    assert linear_dtypes == {torch.float32}


def test_an_fp32_run_resumes_under_auto_on_a_bf16_cpu(
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    linear_dtypes: set[torch.dtype],
) -> None:
    """The checkpoint of an fp32 run resumes under the default (the precision is not part of the resume
    fingerprint); the resumed steps compute in bf16 and the driver says that the precision changed."""
    monkeypatch.setenv(FEATURES_VARIABLE, NO_BF16)
    first = train(
        small_run_config(synthetic_sources, tmp_path, **STEPS, **{"training.dense_precision": "fp32"})
    )
    assert first["steps"] == 2 and linear_dtypes == {torch.float32}
    (tmp_path / "summary.json").unlink()  # as if the run had stopped at step 2
    linear_dtypes.clear()
    monkeypatch.setenv(FEATURES_VARIABLE, ZEN4)
    more = STEPS | {"training.max_steps": 4}
    with caplog.at_level(logging.WARNING, logger="psrec.train.loop"):
        resumed = train(small_run_config(synthetic_sources, tmp_path, **more), resume=True)
    assert resumed["resumed_from"]["step"] == 2 and resumed["steps"] == 4
    assert resumed["dense_precision"]["resolved"] == "bf16" and linear_dtypes == {torch.bfloat16}
    warnings = [r.getMessage() for r in caplog.records if r.name == "psrec.train.loop"]
    assert any("trained in fp32; training goes on in bf16" in message for message in warnings), warnings


def test_a_ray_trainer_resolves_auto_on_its_own_machine(
    synthetic_sources: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: None
) -> None:
    """The driver's process says native bf16, the trainer actor's (started with the cluster, under the
    suite's pinned features) says none: the trainer's machine decides, and the summary names it."""
    monkeypatch.setenv(FEATURES_VARIABLE, ZEN4)  # the driver only
    config = small_run_config(synthetic_sources, tmp_path, **STEPS, **{"ps.runtime": "ray"})
    summary = train(config)
    assert summary["dense_precision"]["resolved"] == "fp32"
    assert summary["machine"]["isa_features"] == ["avx2", "avx512f"]  # tests/conftest.py's
