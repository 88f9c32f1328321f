"""`psrec bench` harness: every system runs two tiny steps and returns sane numbers (no timing asserts).

Run: `python -m pytest tests/bench -q` (about 30 s; one embedded Ray cluster for the Ray system).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from psrec.bench import cli as commands
from psrec.bench import harness
from psrec.bench.harness import run_bench, step_profile, summarize
from psrec.bench.psrec_systems import _timed_rate, epoch_steps
from psrec.bench.systems import DEFAULT_SYSTEMS, REFERENCES, SYSTEMS, reference, resolve_systems
from psrec.bench.workload import Workload


def tiny_workload(cache: Path, **overrides: Any) -> Workload:
    """A bench workload small enough for a test: a few hundred rows, two timed steps."""
    return Workload(
        dim=16,
        batch_size=256,
        train_rows=2048,
        validation_rows=512,
        cardinality_scale=0.001,
        warmup_steps=1,
        steps=2,
        threads=1,
        cache_dir=str(cache),
        **overrides,
    )


def test_resolve_systems_expands_letters_and_rejects_unknown() -> None:
    assert resolve_systems("a,c,e") == [
        "pytorch",
        "pytorch-bf16",
        "psrec",
        "psrec-bf16",
        "ceiling",
        "ceiling-bf16",
    ]
    assert resolve_systems("a,pytorch") == ["pytorch", "pytorch-bf16"]
    assert resolve_systems("pytorch,a") == ["pytorch", "pytorch-bf16"]
    with pytest.raises(ValueError, match="unknown system"):
        resolve_systems("a,nope")


def test_summarize_takes_ratios_within_rounds() -> None:
    runs = [
        {"system": "pytorch", "round": 0, "samples_per_second": 100.0},
        {"system": "psrec", "round": 0, "samples_per_second": 200.0},
        {"system": "ceiling", "round": 0, "samples_per_second": 400.0},
        {"system": "pytorch", "round": 1, "samples_per_second": 10.0},  # a noisy round
        {"system": "psrec", "round": 1, "samples_per_second": 30.0},
        {"system": "ceiling", "round": 1, "error": "boom"},
    ]
    rows = {row["system"]: row for row in summarize(runs, ["pytorch", "psrec", "ceiling"])}
    assert rows["psrec"]["ratio_to_pytorch"] == pytest.approx(2.5)  # median of 2.0 and 3.0
    assert rows["psrec"]["fraction_of_ceiling"] == pytest.approx(0.5)
    assert rows["ceiling"]["status"].startswith("1/2 runs failed")


def test_fraction_of_ceiling_is_at_the_same_precision_and_compile() -> None:
    runs = [
        {"system": "psrec-bf16", "round": 0, "samples_per_second": 300.0},
        {"system": "psrec-bf16-compile", "round": 0, "samples_per_second": 360.0},
        {"system": "ceiling", "round": 0, "samples_per_second": 250.0},
        {"system": "ceiling-bf16", "round": 0, "samples_per_second": 400.0},
        {"system": "ceiling-bf16-compile", "round": 0, "samples_per_second": 600.0},
    ]
    names = [run["system"] for run in runs]
    rows = {row["system"]: row for row in summarize(runs, names)}
    assert rows["psrec-bf16"]["fraction_of_ceiling"] == pytest.approx(0.75)
    assert rows["psrec-bf16-compile"]["fraction_of_ceiling"] == pytest.approx(0.6)
    assert rows["ceiling-bf16-compile"]["fraction_of_ceiling"] == pytest.approx(1.0)
    # Without its own ceiling in the run a system has no fraction (never the fp32 one's).
    rows = {row["system"]: row for row in summarize(runs[:3], names[:3])}
    assert rows["psrec-bf16"]["fraction_of_ceiling"] is None


def test_peak_rss_is_the_median_of_rounds_beside_samples_per_second() -> None:
    gib = 2**30
    runs = [
        {"system": "torchrec", "round": 0, "samples_per_second": 100.0, "peak_rss_bytes": 2 * gib},
        {"system": "psrec", "round": 0, "samples_per_second": 120.0, "peak_rss_bytes": 1.5 * gib},
        {"system": "torchrec", "round": 1, "samples_per_second": 100.0, "peak_rss_bytes": 1.6 * gib},
        {"system": "psrec", "round": 1, "samples_per_second": 120.0, "peak_rss_bytes": 1.6 * gib},
        {"system": "torchrec", "round": 2, "samples_per_second": 100.0, "peak_rss_bytes": 1.7 * gib},
        {
            "system": "psrec",
            "round": 2,
            "samples_per_second": 120.0,
            "peak_rss_bytes": 1.4 * gib,
            "training_peak_rss_bytes": 1.2 * gib,
        },
    ]
    rows = {row["system"]: row for row in summarize(runs, ["torchrec", "psrec"])}
    psrec = rows["psrec"]
    assert psrec["peak_rss_bytes"] == pytest.approx(1.5 * gib)  # the median, not the largest
    assert psrec["peak_rss_max_bytes"] == pytest.approx(1.6 * gib)
    assert psrec["peak_rss_bytes_all"] == pytest.approx([1.5 * gib, 1.6 * gib, 1.4 * gib])
    # within-round ratios (0.75, 1.0, 1.4 / 1.7), then their median
    assert psrec["rss_ratio_to_torchrec"] == pytest.approx(1.4 / 1.7)
    assert psrec["rss_ratio_to_pytorch"] is None  # no plain PyTorch ran
    assert psrec["training_peak_rss_bytes"] == pytest.approx(1.2 * gib)  # from the runs that say it
    assert rows["torchrec"]["training_peak_rss_bytes"] is None
    report = {
        "workload": tiny_workload(Path("unused")).to_dict(),
        "machine": {"cpu": "test cpu", "cores": 2, "load_average": [0.0, 0.0, 0.0]},
        "rounds": 3,
        "rows": list(rows.values()),
    }
    lines = commands.format_table(report).splitlines()
    assert lines[2].split()[:6] == ["system", "precision", "samples/s", "peak", "RSS", "RSS"]
    (line,) = [line for line in lines if line.startswith("psrec ")]
    assert line.split()[2:5] == ["120", "1.50G", "0.82"]  # samples/s, peak RSS, RSS x trec


def precision_runs() -> list[dict[str, object]]:
    rates = {
        "pytorch": 100.0,
        "pytorch-bf16": 150.0,
        "torchrec": 110.0,
        "psrec": 120.0,
        "psrec-bf16": 300.0,
        "psrec-fp16rows": 130.0,
        "ceiling": 200.0,
        "ceiling-bf16": 400.0,
    }
    return [{"system": name, "round": 0, "samples_per_second": rate} for name, rate in rates.items()]


def test_ratios_are_taken_only_between_equal_precisions() -> None:
    runs = precision_runs()
    rows = {row["system"]: row for row in summarize(runs, [str(run["system"]) for run in runs])}
    bf16 = rows["psrec-bf16"]
    assert bf16["precision"] == "bf16"
    assert bf16["ratio_to_pytorch"] == pytest.approx(2.0)  # by pytorch-bf16 (150), not pytorch (100)
    assert bf16["ratio_to_torchrec"] is None  # no bf16 TorchRec ran: no ratio, never the fp32 one's
    assert bf16["ratio_to_psrec"] == pytest.approx(1.0)
    assert bf16["ratio_to_fp32"] == pytest.approx(2.5)  # the one cross-precision figure, over psrec
    assert rows["psrec"]["ratio_to_pytorch"] == pytest.approx(1.2)
    assert rows["psrec"]["ratio_to_torchrec"] == pytest.approx(120 / 110)
    assert rows["psrec"]["ratio_to_fp32"] is None
    # x best peer: the fastest peer at the same precision (TorchRec for fp32, pytorch-bf16 for bf16).
    assert rows["psrec"]["ratio_to_best_peer"] == pytest.approx(120 / 110)
    assert bf16["ratio_to_best_peer"] == pytest.approx(2.0)
    # fp16 rows: no plain PyTorch or TorchRec with fp16 rows ran; against fp32 psrec only as "x fp32".
    fp16rows = rows["psrec-fp16rows"]
    assert fp16rows["ratio_to_pytorch"] is None and fp16rows["ratio_to_torchrec"] is None
    assert fp16rows["ratio_to_fp32"] == pytest.approx(130 / 120)
    assert fp16rows["ratio_to_best_peer"] is None  # no peer with fp16 rows ran
    assert rows["pytorch-bf16"]["ratio_to_pytorch"] == pytest.approx(1.0)
    assert rows["pytorch-bf16"]["fraction_of_ceiling"] == pytest.approx(150 / 400)
    assert rows["ceiling-bf16"]["ratio_to_pytorch"] == pytest.approx(400 / 150)
    # Without the bf16 baseline in the run the bf16 system gets no "x pytorch".
    without = [run for run in runs if run["system"] != "pytorch-bf16"]
    rows = {row["system"]: row for row in summarize(without, [str(run["system"]) for run in without])}
    assert rows["psrec-bf16"]["ratio_to_pytorch"] is None


def test_every_reference_is_a_system_of_the_same_precision() -> None:
    for name, system in SYSTEMS.items():
        for kind in REFERENCES:
            target = reference(name, kind)
            if target is not None:
                assert SYSTEMS[target].precision == system.precision, (name, kind, target)
        assert SYSTEMS[system.ceiling].precision == system.dense_precision, name
        if system.fp32_twin is not None:
            assert SYSTEMS[system.fp32_twin].precision == "fp32" != system.precision, name
    # The bf16 baselines exist (plain PyTorch under autocast, TorchRec, the ceiling).
    assert [reference("psrec-bf16", kind) for kind in REFERENCES] == [
        "pytorch-bf16",
        "torchrec-bf16",
        "tensorflow-bf16",
        "psrec-bf16",
    ]
    assert SYSTEMS["psrec-bf16"].ceiling == "ceiling-bf16"
    assert {"pytorch-bf16", "torchrec-bf16", "ceiling-bf16"} <= set(DEFAULT_SYSTEMS)


def test_table_shows_precisions_and_marks_the_cross_precision_figure() -> None:
    runs = precision_runs()
    names = [str(run["system"]) for run in runs]
    report = {
        "workload": tiny_workload(Path("unused")).to_dict(),
        "machine": {"cpu": "test cpu", "cores": 2, "load_average": [0.0, 0.0, 0.0]},
        "rounds": 1,
        "rows": summarize(runs, names),
    }
    lines = commands.format_table(report).splitlines()
    assert "CROSS-PRECISION" in lines[1] and "x fp32*" in lines[2] and "precision" in lines[2]
    assert "x TF" in lines[2] and "x peer" in lines[2]
    (bf16,) = [line for line in lines if line.startswith("psrec-bf16 ")]
    cells = bf16.split()
    assert cells[1] == "bf16" and cells[5] == "2.00"  # x pytorch: over pytorch-bf16
    assert cells[6] == "-"  # x torchrec: no bf16 TorchRec in the run
    assert cells[7] == "-"  # x TF: no TensorFlow in the run
    assert cells[8] == "2.00"  # x peer: the fastest bf16 peer is pytorch-bf16
    assert "2.50*" in cells  # x fp32, marked
    (fp32,) = [line for line in lines if line.startswith("psrec ")]
    assert fp32.split()[11] == "-"  # fp32 psrec has no fp32 twin: nothing crosses precisions


def test_step_profile_accounts_for_the_whole_step() -> None:
    run = {"steps": 4, "train_seconds": 2.0, "phase_seconds": {"pull": 0.4, "forward": 1.0}}
    profile = step_profile(run)
    assert profile["pull"] == pytest.approx(100.0)
    assert profile["other"] == pytest.approx(150.0)
    assert profile["total"] == pytest.approx(500.0)


def test_timed_rate_can_leave_out_the_first_epoch() -> None:
    # cumulative reports: (epoch, samples, samples/s over all training so far, cpu); the wall clock
    # at each report is the training time so far (no driver work between chunks)
    points = [(0, 100, 50.0, 1.0), (0, 200, 50.0, 2.0), (1, 300, 60.0, 3.0), (1, 500, 62.5, 4.0)]
    reports = [
        {"epoch": e, "step": n // 100, "samples": n, "samples_per_second": r, "clock": n / r, "cpu": c}
        for e, n, r, c in points
    ]
    everything = _timed_rate(reports, has_warmup=True)
    assert everything["timed_samples"] == 400 and everything["timed_seconds"] == pytest.approx(6.0)
    second = _timed_rate(reports, has_warmup=True, from_epoch=1)  # warm-up = epoch 1's first chunk
    assert second["timed_samples"] == 200 and second["timed_seconds"] == pytest.approx(3.0)
    assert second["samples_per_second"] == pytest.approx(200 / 3.0) and second["timed_steps"] == 2


def test_cached_system_times_the_second_epoch(tmp_path: Path) -> None:
    workload = tiny_workload(tmp_path / "cache")
    report = run_bench(workload, ["psrec-cached"], rounds=1, isolate=False)
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["samples_per_second"] > 0
    (run,) = report["runs"]
    first_epoch = epoch_steps(workload)
    assert run["steps"] == first_epoch + workload.warmup_steps + workload.steps
    assert run["timed_steps"] == workload.steps


def test_row_precision_systems_store_every_table_in_that_precision(tmp_path: Path) -> None:
    from psrec.bench.psrec_systems import PsrecLayout, PsrecOptions, bench_config
    from psrec.config import parse_config

    workload = tiny_workload(tmp_path / "cache")
    config = parse_config(
        bench_config(
            workload, str(tmp_path / "run"), PsrecLayout("local"), PsrecOptions(row_precision="int8")
        )
    )
    assert config.embedding.tables and {t.precision for t in config.embedding.tables.values()} == {"int8"}
    report = run_bench(workload, ["psrec-fp16rows"], rounds=1, isolate=False)
    (row,) = report["rows"]
    assert row["status"] == "ok" and 0.0 <= row["auc"] <= 1.0
    assert 0 < row["seconds_to_first_step"] < 60  # the run's start-up, from its summary
    assert 0 < row["training_peak_rss_bytes"] <= row["peak_rss_bytes"]  # read before evaluation
    assert "1st step s" in commands.format_profile(report)


@pytest.mark.ray
def test_every_system_runs_and_reports_sane_numbers(tmp_path: Path, ray_cluster: None) -> None:
    workload = tiny_workload(tmp_path / "cache")
    report = run_bench(workload, DEFAULT_SYSTEMS, rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    assert set(rows) == set(DEFAULT_SYSTEMS)
    for name, row in rows.items():
        if name.startswith("torchrec") and row["status"].startswith("skipped"):
            continue  # optional extra not installed: the bench says why
        assert row["status"] == "ok", (name, row["status"])
        assert row["samples_per_second"] > 0 and math.isfinite(row["samples_per_second"])
        assert row["samples_per_cpu_second"] > 0 and row["best_step_samples_per_second"] > 0
        assert row["peak_rss_bytes"] > 0
        if not name.startswith("ceiling"):
            assert 0.0 <= row["auc"] <= 1.0
    assert rows["pytorch"]["ratio_to_pytorch"] == pytest.approx(1.0)
    assert rows["pytorch-bf16"]["ratio_to_pytorch"] == pytest.approx(1.0)  # bf16 over bf16
    for name in ("psrec", "psrec-ray"):
        profile = rows[name]["profile"]
        assert {"pull", "forward", "backward", "push", "optimizer"} <= set(profile)
        assert profile["total"] >= profile["forward"] > 0
        assert rows[name]["bytes_pulled_per_sample"] > 0 and rows[name]["bytes_pushed_per_sample"] > 0
    table = commands.format_table(report)
    assert "psrec-ray" in table and "x pytorch" in table
    assert "forward" in commands.format_profile(report)


def test_isolated_run_reports_from_its_own_process(tmp_path: Path) -> None:
    report = run_bench(tiny_workload(tmp_path / "cache"), ["pytorch"], rounds=1, isolate=True)
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["samples_per_second"] > 0
    assert 0 < row["training_peak_rss_bytes"] <= row["peak_rss_bytes"] < 8 * 2**30  # its own process


def test_load_average_is_read_before_and_after_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readings = iter([(1.0, 1.0, 1.0), (3.0, 2.0, 1.0)])
    monkeypatch.setattr(harness.os, "getloadavg", lambda: next(readings))
    report = run_bench(tiny_workload(tmp_path / "cache"), ["ceiling"], rounds=1, isolate=False)
    assert report["machine"]["load_average"][0] == 1.0  # before the first run
    assert report["machine"]["load_average_end"][0] == 3.0
    header = commands.format_table(report).splitlines()[0]
    assert "load 1.00 at start, 3.00 at end" in header


def test_the_header_names_the_machine_and_the_table_warns_of_emulated_bf16() -> None:
    runs = precision_runs() + [
        {"system": "pytorch-bf16-rowwise", "round": 0, "samples_per_second": 90.0, "device": "cuda"}
    ]
    names = [str(run["system"]) for run in runs]

    def report(features: list[str], *, gpu_bf16: bool = False) -> dict[str, Any]:
        machine = {"cpu": "Intel Xeon", "isa_features": features, "cores": 2, "load_average": [0.5, 0.4, 0.3]}
        machine |= {"gpu": "H100", "gpu_bf16": gpu_bf16}
        return {
            "workload": tiny_workload(Path("unused")).to_dict(),
            "machine": machine,
            "rounds": 1,
            "rows": summarize(runs, names),
        }

    intel = report(["avx2", "avx512f", "avx512_vnni"])
    lines = commands.format_table(intel).splitlines()
    assert "Intel Xeon [avx2 avx512f avx512_vnni] (2 cores), load 0.50 at start" in lines[0]
    assert commands.emulated_bf16_systems(intel) == [
        "pytorch-bf16",
        "psrec-bf16",
        "ceiling-bf16",
        "pytorch-bf16-rowwise",  # on a GPU without bf16
    ]
    assert lines[-1].startswith("warning: bf16 runs emulated here (pytorch-bf16, psrec-bf16, ceiling-bf16, ")
    assert "0.38-0.39x" in lines[-1]
    native = report(["avx2", "avx512f", "avx512_bf16"], gpu_bf16=True)
    assert commands.emulated_bf16_systems(native) == []
    assert "warning" not in commands.format_table(native)
    assert commands.emulated_bf16_systems(report(["amx_bf16"])) == ["pytorch-bf16-rowwise"]
    assert commands.machine_line(intel["machine"]) == (
        "machine: Intel Xeon [avx2 avx512f avx512_vnni], 2 cores, load average 0.50, 0.40, 0.30; GPU H100"
    )


def test_the_bench_warns_before_running_bf16_on_a_cpu_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psrec.machine import FEATURES_VARIABLE

    workload = tiny_workload(tmp_path)
    monkeypatch.setenv(FEATURES_VARIABLE, "avx2,avx512f")
    warning = commands.planned_emulation_warning("c,psrec-ray", workload)
    assert warning is not None and "(psrec-bf16)" in warning
    assert commands.planned_emulation_warning("psrec,pytorch", workload) is None
    assert harness.machine_description()["isa_features"] == ["avx2", "avx512f"]
    monkeypatch.setenv(FEATURES_VARIABLE, "avx2,avx512f,amx_bf16")
    assert commands.planned_emulation_warning("c", workload) is None
