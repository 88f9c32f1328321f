"""The scaling model (`psrec.bench.throughput_model`) against arithmetic done by hand, and its command line.

The oracle of every number here is the arithmetic written out in the test, not the model's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psrec.bench import throughput_model as scaling
from psrec.bench.throughput_model import (
    BYTES_PER_GBIT,
    StepCosts,
    predict,
    prediction_table,
    rate_text,
    step_seconds,
)

ROOT = Path(__file__).resolve().parents[2]

# batch 1000; 100 ms of trainer work; 1 us of shard work per sample; 5 ms of Ray overhead per call;
# 400 + 600 bytes per sample; 1M dense parameters; 40 us of CPU per sample in process, 5 us more on Ray
COSTS = StepCosts(
    batch_size=1000,
    trainer_seconds=0.1,
    shard_seconds_per_sample=1e-6,
    rpc_seconds=0.005,
    bytes_pulled_per_sample=400.0,
    bytes_pushed_per_sample=600.0,
    dense_parameters=1_000_000,
    cpu_seconds_per_sample=40e-6,
    ray_cpu_seconds_per_sample=5e-6,
)
TEN_GBPS = 1.25e9  # bytes/s


def test_eight_trainers_on_four_shards_at_10_gbps() -> None:
    # wire: each shard serves 2 trainers: 2 x 1000 x 1000 B / 1.25e9 B/s = 1.6 ms
    # shard: 8 x 1000 x 1 us / 4 = 2 ms; allreduce: 2 x 7/8 x 4 MB / 1.25e9 B/s = 5.6 ms; rpc: 2 x 5 ms
    expected_step = 0.1 + 0.010 + 0.0016 + 0.002 + 0.0056  # 119.2 ms
    assert step_seconds(COSTS, trainers=8, shards=4, bandwidth=TEN_GBPS) == pytest.approx(expected_step)
    out = predict(COSTS, trainers=8, shards=4, bandwidth=TEN_GBPS, shared_cores=2)
    assert out["dedicated"] == pytest.approx(8000 / 0.1192)  # 67,114 samples/s
    assert out["cpu_bound"] == pytest.approx(2 / 45e-6)  # 44,444: 2 cores / (40 + 5 us)
    assert out["predicted"] == pytest.approx(2 / 45e-6)


def test_queued_calls_cost_the_shards_load_in_round_trips() -> None:
    # 2 trainers per shard: 2 x 5 ms x 2 = 20 ms of round trips instead of 10
    queued = predict(COSTS, trainers=8, shards=4, bandwidth=TEN_GBPS, rpc_queued=True)
    assert queued["dedicated"] == pytest.approx(8000 / 0.1292)
    # a shard per trainer or more: nothing queues
    assert predict(COSTS, trainers=2, shards=4, bandwidth=TEN_GBPS, rpc_queued=True) == predict(
        COSTS, trainers=2, shards=4, bandwidth=TEN_GBPS
    )


def test_one_trainer_on_loopback_is_its_work_plus_round_trips() -> None:
    # infinite bandwidth: no wire, no allreduce (one trainer); shard 1000 x 1 us = 1 ms
    assert predict(COSTS, trainers=1, shards=2)["dedicated"] == pytest.approx(1000 / (0.1 + 0.010 + 0.0005))
    assert predict(COSTS, trainers=1, shards=1)["dedicated"] == pytest.approx(1000 / (0.1 + 0.010 + 0.001))
    # in process: no round trips and no Ray CPU
    local = predict(COSTS, trainers=1, shards=1, remote=False, shared_cores=1)
    assert local["dedicated"] == pytest.approx(1000 / 0.101)
    assert local["cpu_bound"] == pytest.approx(1 / 40e-6)


def test_a_shard_serving_many_trainers_carries_their_bytes() -> None:
    # 128 trainers on 32 shards at 100 Gb/s (1.25e10 B/s): wire 4 x 1e6 / 1.25e10 = 0.32 ms;
    # shard 128 x 1000 x 1 us / 32 = 4 ms; allreduce 2 x 127/128 x 4e6 / 1.25e10 = 0.635 ms
    step = 0.1 + 0.010 + 0.00032 + 0.004 + 2 * 127 / 128 * 4e6 / 1.25e10
    hundred = 100 * BYTES_PER_GBIT
    assert predict(COSTS, trainers=128, shards=32, bandwidth=hundred)["dedicated"] == pytest.approx(
        128_000 / step
    )


def test_from_runs_takes_the_shard_work_and_ray_overhead_apart() -> None:
    local = {
        "profile": {"total": 100.0, "pull": 2.0, "push": 2.0},
        "samples_per_cpu_second": 25_000.0,
        "bytes_pulled_per_sample": 900.0,
        "bytes_pushed_per_sample": 950.0,
    }
    ray = {"profile": {"total": 115.0, "pull": 8.0, "push": 6.0}, "samples_per_cpu_second": 20_000.0}
    costs = StepCosts.from_runs(local, ray, batch_size=4000, dense_parameters=10)
    assert costs.trainer_seconds == pytest.approx(0.096)  # 100 - (2 + 2) ms
    assert costs.shard_seconds_per_sample == pytest.approx(0.004 / 4000)  # 1 us
    assert costs.rpc_seconds == pytest.approx(0.005)  # ((8 + 6) - (2 + 2)) / 2 ms
    assert costs.cpu_seconds_per_sample == pytest.approx(40e-6)
    assert costs.ray_cpu_seconds_per_sample == pytest.approx(10e-6)  # 50 - 40 us
    assert (costs.bytes_pulled_per_sample, costs.bytes_pushed_per_sample) == (900.0, 950.0)


def test_prediction_table_rows_and_columns() -> None:
    table = prediction_table(COSTS, [(8, 4), (1, 1)], gbps=[10.0], queued_gbps=[10.0])
    assert [(row["trainers"], row["shards"]) for row in table] == [(8, 4), (1, 1)]
    assert table[0]["samples_per_second"][10.0] == pytest.approx(8000 / 0.1192)
    assert table[0]["queued"][10.0] == pytest.approx(8000 / 0.1292)
    # 1 x 1 at 10 Gb/s: wire 1e6 / 1.25e9 = 0.8 ms, shard 1 ms
    assert table[1]["samples_per_second"][10.0] == pytest.approx(1000 / (0.1 + 0.010 + 0.0008 + 0.001))
    text = scaling.format_predictions(table)
    assert text.splitlines()[0] == "| layout N x M | 10 Gb/s | 10 Gb/s, rpc queued |"
    assert "| 8 x 4 | 67.1k | 61.9k |" in text


@pytest.mark.parametrize(
    ("value", "text"),
    [(946.4, "946"), (24_430.0, "24.4k"), (265_400.0, "265k"), (1_834_000.0, "1.83M"), (999_700.0, "1.00M")],
)
def test_rates_read_to_three_figures(value: float, text: str) -> None:
    assert rate_text(value) == text


def test_dense_parameters_of_the_bench_dlrm() -> None:
    # bottom 13-512-256-64: 13*512+512 + 512*256+256 + 256*64+64 = 154,944
    # top (64 + 27*26/2 = 415)-512-256-1: 415*512+512 + 512*256+256 + 256+1 = 344,577
    workload = {"dim": 64}
    assert scaling.dense_parameters(workload) == 154_944 + 344_577


def _row(
    system: str, samples: float, cpu: float, profile: dict[str, float], **extra: object
) -> dict[str, object]:
    return {
        "system": system,
        "samples_per_second": samples,
        "samples_per_cpu_second": cpu,
        "profile": profile,
        "bytes_pulled_per_sample": 900.0,
        "bytes_pushed_per_sample": 950.0,
        **extra,
    }


def test_the_command_prints_inputs_check_and_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        _row("psrec", 40_000, 24_000, {"total": 100.0, "pull": 2.0, "push": 2.0}),
        _row("psrec-ray", 35_000, 21_000, {"total": 110.0, "pull": 7.0, "push": 5.0}),
        _row("psrec-t1", 25_000, 24_500, {"total": 160.0, "pull": 2.0, "push": 2.0}),
        _row("psrec-ray-t1", 23_000, 22_000, {"total": 170.0, "pull": 7.0, "push": 5.0}),
        _row("psrec-ray-2x2", 30_000, 20_000, {"total": 200.0, "pull": 9.0, "push": 7.0}),
        _row(
            "psrec-ray-2x2-nodes",
            28_000,
            19_000,
            {"total": 210.0, "pull": 12.0, "push": 9.0},
            bytes_pulled_per_sample=901.0,
            placement={"nodes_used": 2},
            ray_daemons_cpu_seconds_per_sample=4.25e-6,
        ),
    ]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"workload": {"dim": 64, "batch_size": 4096}, "rows": rows}))
    assert scaling.main([str(report), "--layouts", "8x4,128x32", "--gbps", "10,100"]) == 0
    out = capsys.readouterr().out
    assert "| bytes pulled per sample, p | 901 B |" in out  # from the across-nodes run
    nodes_row = next(
        line for line in out.splitlines() if line.startswith("| `psrec-ray-2x2-nodes` | 2 | 28,000 |")
    )
    # CPU-s; raylets' us/smp; cores busy: 28,000 x (1 / 19,000 + 4.25e-6) = 1.474 + 0.119; bytes
    assert "| 19,000 | 4.2 | 1.59 | 901 | 950 |" in nodes_row
    assert "| `psrec-ray-2x2` | 1 | 30,000 |" in out and "| 20,000 | - | 1.50 | 900 | 950 |" in out
    assert "| layout N x M | 10 Gb/s | 100 Gb/s | 10 Gb/s, rpc queued | 100 Gb/s, rpc queued |" in out
    assert "| 128 x 32 |" in out


def test_the_command_refuses_reports_of_different_workloads(tmp_path: Path) -> None:
    for name, dim in (("a.json", 64), ("b.json", 16)):
        (tmp_path / name).write_text(json.dumps({"workload": {"dim": dim}, "rows": []}))
    with pytest.raises(ValueError, match="different workloads"):
        scaling.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_the_docs_tables_are_what_the_stored_report_gives(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/scaling.md shows the command's output for docs/data/scaling.json as it is."""
    scaling.main([str(ROOT / "docs" / "data" / "scaling.json")])
    out = capsys.readouterr().out
    doc = (ROOT / "docs" / "scaling.md").read_text()
    tables = [block for block in out.split("\n\n") if block.startswith("|")]
    assert len(tables) == 3  # inputs, check, predictions
    for table in tables:
        assert table.strip() in doc, f"docs/scaling.md lacks this table of the stored report:\n{table}"
