"""`training.device`: how it resolves, what the config refuses, and that cpu never touches CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from psrec.config import ConfigError
from psrec.parallel.rendezvous import backend_for
from psrec.train.loop import train
from psrec.trainer import builders
from psrec.trainer.device import resolve_device
from tests.conftest import small_run_config

SOURCES: dict[str, Any] = {"train": {"format": "parquet", "paths": ["unused/*.parquet"]}}
NO_CUDA = not torch.cuda.is_available()


def test_resolution_is_a_pure_function_of_the_setting_and_the_process() -> None:
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True, pipeline=True) == "cpu"
    assert resolve_device("cuda", cuda_available=True) == "cuda"
    with pytest.raises(ConfigError, match=r"training.device 'cuda'.*no CUDA device.*set training.device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ConfigError, match="training.device must be one of cpu, cuda, auto"):
        resolve_device("gpu", cuda_available=True)


def test_the_default_cpu_device_never_asks_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden() -> bool:
        raise AssertionError("training.device cpu must not touch torch.cuda")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    config = small_run_config(SOURCES, tmp_path)
    assert config.training.device == "cpu"
    assert builders.training_device(config) == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_a_config_error_saying_what_to_do(tmp_path: Path) -> None:
    config = small_run_config(SOURCES, tmp_path, **{"training.device": "cuda"})
    with pytest.raises(ConfigError) as error:
        builders.training_device(config)
    message = str(error.value)
    assert "training.device 'cuda'" in message and "num_gpus" in message and "auto" in message
    auto = small_run_config(SOURCES, tmp_path, **{"training.device": "auto"})
    assert builders.training_device(auto) == torch.device("cpu")


def test_the_config_refuses_what_cannot_run_on_a_gpu(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"training.device.*Input should be 'cpu', 'cuda' or 'auto'"):
        small_run_config(SOURCES, tmp_path, **{"training.device": "gpu"})
    with pytest.raises(ConfigError, match=r"needs ps.trainer_resources.num_gpus > 0"):
        small_run_config(SOURCES, tmp_path, **{"training.device": "cuda", "ps.runtime": "ray"})
    config = small_run_config(
        SOURCES,
        tmp_path,
        **{"training.device": "cuda", "ps.runtime": "ray", "ps.trainer_resources": {"num_gpus": 1}},
    )
    assert config.training.device == "cuda"


def test_the_device_is_not_part_of_the_checkpoint_fingerprint(tmp_path: Path) -> None:
    """A checkpoint holds host tensors: a run saved on a GPU resumes on the CPU and back."""
    cpu = small_run_config(SOURCES, tmp_path)
    auto = small_run_config(SOURCES, tmp_path, **{"training.device": "auto"})
    assert cpu.fingerprint() == auto.fingerprint()
    assert "device" not in cpu.fingerprint_dict()["training"]


def test_gpu_trainers_reduce_gpu_tensors_with_nccl_and_the_rest_with_gloo() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_in_process_training_on_cuda_matches_the_cpu_run(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """The whole run (in-process runtime, evaluation, checkpoint) on the GPU, against the same run on
    the CPU: float32 on other kernels, so equal within tolerance. SGD for the dense model (see
    tests/trainer/test_device_lookup.py)."""
    options: dict[str, Any] = {
        "training.max_steps": 30,
        "training.dense_optimizer": {"name": "sgd", "lr": 0.05},
        "training.dense_precision": "fp32",  # auto would be bf16 on a GPU that computes it
    }
    cpu = train(small_run_config(synthetic_sources, tmp_path / "cpu", **options))
    gpu_config = small_run_config(
        synthetic_sources, tmp_path / "cuda", **options, **{"training.device": "cuda"}
    )
    assert builders.training_device(gpu_config).type == "cuda"
    gpu = train(gpu_config)
    assert gpu["steps"] == cpu["steps"] == 30
    assert gpu["samples"] == cpu["samples"]
    for metric in ("auc", "logloss"):
        assert gpu["validation"][metric] == pytest.approx(cpu["validation"][metric], rel=1e-3, abs=1e-4)
    assert {t: v["rows"] for t, v in gpu["tables"].items()} == {
        t: v["rows"] for t, v in cpu["tables"].items()
    }
    assert list((tmp_path / "cuda").glob("checkpoints/*"))  # its dense state was written from host copies
