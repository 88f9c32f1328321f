"""`psrec bench --device`: where the systems train, and the report saying so (`gpu` tier for cuda runs).

Run: `python -m pytest tests/bench/test_bench_device.py -q`; on a GPU machine add `-m gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psrec.bench import cli as commands
from psrec.bench.harness import run_bench
from psrec.bench.psrec_systems import PsrecLayout, bench_config, psrec_device
from psrec.bench.workload import Workload
from psrec.cli import build_parser, main
from psrec.config import parse_config
from tests.bench.test_bench import tiny_workload

NO_CUDA = not torch.cuda.is_available()


def test_the_device_option_resolves_to_what_this_machine_has(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    here = "cpu" if NO_CUDA else "cuda"
    assert commands.workload_from_args(parse(["bench"])).device == here  # auto
    assert commands.workload_from_args(parse(["bench", "--device", "cpu"])).device == "cpu"
    with pytest.raises(SystemExit):
        parse(["bench", "--device", "tpu"])
    if NO_CUDA:
        assert main(["bench", "--device", "cuda"]) == 2
        assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        Workload(device="auto").check()


def test_psrec_systems_train_on_the_workloads_device(tmp_path: Path) -> None:
    cpu = bench_config(tiny_workload(tmp_path), "run", PsrecLayout("ray"))
    assert cpu["training"]["device"] == "cpu" and "num_gpus" not in cpu["ps"]["trainer_resources"]
    many = PsrecLayout("ray", num_trainers=torch.cuda.device_count() + 1)
    assert psrec_device(tiny_workload(tmp_path, device="cuda"), many) == "cpu"  # NCCL: one GPU per trainer
    if not NO_CUDA:
        gpu = bench_config(tiny_workload(tmp_path, device="cuda"), "run", PsrecLayout("ray"))
        assert gpu["training"]["device"] == "cuda" and gpu["ps"]["trainer_resources"]["num_gpus"] == 1
        assert parse_config(gpu).training.device == "cuda"


def test_the_report_says_where_each_system_ran(tmp_path: Path) -> None:
    report = run_bench(tiny_workload(tmp_path / "cache"), ["ceiling", "psrec"], rounds=1, isolate=False)
    assert [row["device"] for row in report["rows"]] == ["cpu", "cpu"]
    lines = commands.format_table(report).splitlines()
    assert "device cpu" in lines[0] and "device" in lines[2].split()
    (ceiling,) = [line for line in lines if line.startswith("ceiling ")]
    assert ceiling.split()[-2:] == ["cpu", "ok"]


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_a_gpu_machine_runs_the_bench_on_the_gpu(tmp_path: Path) -> None:
    workload = tiny_workload(tmp_path / "cache", device="cuda")
    systems = ["pytorch", "pytorch-rowwise", "ceiling", "psrec", "psrec-bf16"]
    report = run_bench(workload, systems, rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    for name in systems:
        assert rows[name]["status"] == "ok", rows[name]["status"]
        assert rows[name]["device"] == "cuda" and rows[name]["samples_per_second"] > 0
    assert 0.0 <= rows["psrec"]["auc"] <= 1.0 and 0.0 <= rows["pytorch"]["auc"] <= 1.0
    assert report["machine"]["gpu"] and "device cuda" in commands.format_table(report).splitlines()[0]
