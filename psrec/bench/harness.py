"""Runs the `psrec bench` systems side by side: interleaved rounds, one fresh process per run, medians.

Every (round, system) pair runs in its own Python process (`python -m psrec.bench.harness`), so
peak RSS is that system's own, thread settings start clean and one system's allocator or OpenMP pool
cannot slow the next. Rounds are interleaved (a b c d e, a b c d e, ...) so that load from other
jobs on the machine hits every system alike; ratios are taken within a round, then the median of the
rounds is reported. `isolate=False` runs everything in this process instead (tests).

    from psrec.bench.harness import run_bench
    from psrec.bench.workload import Workload
    report = run_bench(Workload(dim=64), ["pytorch", "psrec", "ceiling"], rounds=3)
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrec.bench.systems import PEERS, SYSTEMS, reference, resolve_systems
from psrec.bench.workload import Workload, prepare_sources
from psrec.machine import describe_machine

logger = logging.getLogger(__name__)


def run_system(name: str, workload: Workload, sources: dict[str, Any]) -> dict[str, Any]:
    """Run one system in this process; errors become {"error": ...} so that one bad system does not end the bench."""
    if workload.cache_dir is not None:
        os.environ["PSREC_CACHE"] = workload.cache_dir
    started = time.perf_counter()
    try:
        result = SYSTEMS[name].run(workload, sources)
    except Exception as error:  # noqa: BLE001 - reported in the table, the bench goes on
        logger.exception("system %s failed", name)
        result = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
    result["system"] = name
    result["wall_seconds"] = time.perf_counter() - started
    return result


def _run_isolated(name: str, workload: Workload, sources: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="psrec-bench-run-") as tmp:
        request = Path(tmp) / "request.json"
        answer = Path(tmp) / "result.json"
        request.write_text(json.dumps({"system": name, "workload": workload.to_dict(), "sources": sources}))
        command = [sys.executable, "-m", "psrec.bench.harness", str(request), str(answer)]
        env = {**os.environ, **dict(SYSTEMS[name].env)}
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False, env=env
            )
        except subprocess.TimeoutExpired:
            return {"system": name, "error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0 or not answer.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"system": name, "error": f"exit {done.returncode}: {' | '.join(tail)}"[:500]}
        return json.loads(answer.read_text())


def run_bench(
    workload: Workload,
    systems: list[str],
    *,
    rounds: int = 3,
    isolate: bool = True,
    timeout: float = 600.0,
    progress: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Interleaved rounds of every system; returns {"workload", "machine", "runs", "rows"} (see `summarize`)."""
    workload.check()
    requested = resolve_systems(systems)
    systems = list(requested)
    sources = prepare_sources(workload)
    machine = machine_description()  # before the runs: its load average is the load they start under
    runs: list[dict[str, Any]] = []
    for round_index in range(rounds):
        for name in systems:
            if isolate:
                result = _run_isolated(name, workload, sources, timeout)
            else:
                result = run_system(name, workload, sources)
            result["round"] = round_index
            runs.append(result)
            if progress is not None:
                progress(round_index, result)
            if "skipped" in result:  # the same reason holds every round
                systems = [s for s in systems if s != name]
                runs.extend({**result, "round": r} for r in range(round_index + 1, rounds))
    return {
        "workload": workload.to_dict(),
        "machine": {**machine, "load_average_end": list(os.getloadavg())},
        "rounds": rounds,
        "runs": runs,
        "rows": summarize(runs, requested),
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], systems: list[str]) -> list[dict[str, Any]]:
    """One row per system: median samples/s, median within-round ratios to the baselines and ceiling.

    Ratios are taken only between equal precisions: "x pytorch", "x torchrec", "x tensorflow" and
    "x psrec" divide by that kind's system at the same precision (`reference`); "x best peer" divides,
    in each round, by the fastest of the PyTorch, TorchRec and TensorFlow systems at that precision
    that ran in it (by the same measure: wall or CPU); and the ceiling of a system is the
    dense-only ceiling at its settings (`System.ceiling`: bf16 systems against "ceiling-bf16",
    compiled ones against the compiled ceiling); each is None when that system did not run. The one
    cross-precision figure, `ratio_to_fp32`, divides by the system's fp32 twin (`System.fp32_twin`:
    psrec-bf16 by psrec) and is labelled as such wherever it is shown.

    Alongside, the same per CPU-second (CPU time of every thread and process of the system, so a
    system using 2 cores for a step counts twice) and the best step rate over all rounds: on a
    machine shared with other jobs those two move much less than wall-clock medians.

    Memory: ``peak_rss_bytes`` is the median over rounds of each run's peak RSS (every run is a
    fresh process; a Ray run adds its actors' peaks), ``rss_ratio_to_torchrec`` and
    ``rss_ratio_to_pytorch`` the median within-round ratios to those systems at the same
    precision, and ``training_peak_rss_bytes`` the median peak before evaluation (training alone),
    where the system reports it.
    """
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run.get("round", 0), {})[run["system"]] = run

    def rate(run: dict[str, Any] | None, key: str = "samples_per_second") -> float | None:
        return None if run is None or key not in run else float(run[key])

    def ratios(name: str, target: str | None, key: str) -> list[float]:
        out: list[float] = []
        if target is None:
            return out
        for per_system in by_round.values():
            value, reference = rate(per_system.get(name), key), rate(per_system.get(target), key)
            if value is not None and reference:
                out.append(value / reference)
        return out

    def best_peer_ratios(name: str, key: str) -> list[float]:
        peers = [target for target in (reference(name, kind) for kind in PEERS) if target is not None]
        out: list[float] = []
        for per_system in by_round.values():
            value = rate(per_system.get(name), key)
            best = max((r for r in (rate(per_system.get(p), key) for p in peers) if r), default=None)
            if value is not None and best:
                out.append(value / best)
        return out

    rows = []
    for name in systems:
        system = SYSTEMS[name]
        ceiling = system.ceiling
        pytorch, torchrec, tensorflow, psrec = (
            reference(name, kind) for kind in ("pytorch", "torchrec", "tensorflow", "psrec")
        )
        mine = [r for r in runs if r["system"] == name]
        rates = [v for v in (rate(r) for r in mine) if v is not None]
        cpu_rates = [v for v in (rate(r, "samples_per_cpu_second") for r in mine) if v is not None]
        best = [v for v in (rate(r, "best_step_samples_per_second") for r in mine) if v is not None]
        rss = [v for v in (rate(r, "peak_rss_bytes") for r in mine) if v]
        aucs = [r["auc"] for r in mine if r.get("auc") is not None]
        last = next((r for r in reversed(mine) if "samples_per_second" in r), None)
        row: dict[str, Any] = {
            "system": name,
            "label": system.label,
            "precision": system.precision,
            "samples_per_second": _median(rates),
            "samples_per_second_all": rates,
            "ratio_to_pytorch": _median(ratios(name, pytorch, "samples_per_second")),
            "ratio_to_torchrec": _median(ratios(name, torchrec, "samples_per_second")),
            "ratio_to_tensorflow": _median(ratios(name, tensorflow, "samples_per_second")),
            "ratio_to_best_peer": _median(best_peer_ratios(name, "samples_per_second")),
            "fraction_of_ceiling": _median(ratios(name, ceiling, "samples_per_second")),
            "ratio_to_psrec": _median(ratios(name, psrec, "samples_per_second")),
            # Cross-precision: over the same system in fp32 (psrec-bf16 / psrec), labelled so.
            "ratio_to_fp32": _median(ratios(name, system.fp32_twin, "samples_per_second")),
            # Load-robust companions: samples per CPU-second, and the best step (chunk) seen.
            "samples_per_cpu_second": _median(cpu_rates),
            "cpu_ratio_to_pytorch": _median(ratios(name, pytorch, "samples_per_cpu_second")),
            "cpu_ratio_to_tensorflow": _median(ratios(name, tensorflow, "samples_per_cpu_second")),
            "cpu_ratio_to_best_peer": _median(best_peer_ratios(name, "samples_per_cpu_second")),
            "cpu_fraction_of_ceiling": _median(ratios(name, ceiling, "samples_per_cpu_second")),
            "best_step_samples_per_second": max(best) if best else None,
            # Memory: the median over rounds of each run's peak RSS, its median within-round ratio
            # to TorchRec and plain PyTorch at the same precision, and the peak before evaluation.
            "peak_rss_bytes": _median(rss),
            "peak_rss_bytes_all": rss,
            "peak_rss_max_bytes": max(rss) if rss else None,
            "rss_ratio_to_torchrec": _median(ratios(name, torchrec, "peak_rss_bytes")),
            "rss_ratio_to_pytorch": _median(ratios(name, pytorch, "peak_rss_bytes")),
            "training_peak_rss_bytes": _median(
                [float(r["training_peak_rss_bytes"]) for r in mine if r.get("training_peak_rss_bytes")]
            ),
            "auc": _median(aucs),
            "device": next((r["device"] for r in reversed(mine) if "device" in r), None),
            "status": _status(mine),
        }
        if last is not None and "phase_seconds" in last:
            row["profile"] = step_profile(last)
            for key in ("bytes_pulled_per_sample", "bytes_pushed_per_sample", "num_trainers", "num_shards"):
                row[key] = last[key]
            for key in ("placement", "ray_daemons_cpu_seconds_per_sample"):
                if key in last:
                    row[key] = last[key]
            starts = [float(r["seconds_to_first_step"]) for r in mine if r.get("seconds_to_first_step")]
            row["seconds_to_first_step"] = _median(starts)
        rows.append(row)
    return rows


def _status(runs: list[dict[str, Any]]) -> str:
    for run in runs:
        if "skipped" in run:
            return f"skipped: {run['skipped']}"
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        return f"{len(errors)}/{len(runs)} runs failed: {errors[0]}"
    return "ok"


def step_profile(run: dict[str, Any]) -> dict[str, float]:
    """psrec's per-phase milliseconds per step of the timed steps (all steps, warm-up included, for
    runs saved before the timed window was recorded) plus the untimed rest.

    "other" is the timed window's time not in any phase: the chunk's end, Python between phases, the
    driver's work between chunks.
    """
    if run.get("timed_steps"):
        steps, phases, seconds = int(run["timed_steps"]), run["timed_phase_seconds"], run["timed_seconds"]
    else:
        steps, phases, seconds = max(1, int(run["steps"])), run["phase_seconds"], run["train_seconds"]
    profile = {phase: 1000 * value / steps for phase, value in phases.items()}
    critical = sum(ms for phase, ms in profile.items() if not phase.endswith("_overlapped"))
    profile["other"] = max(0.0, 1000 * seconds / steps - critical)
    profile["total"] = 1000 * seconds / steps
    return profile


def machine_description() -> dict[str, Any]:
    """The machine the bench runs on: CPU model and the ISA features that decide bf16's speed
    (`psrec.machine`), cores, memory, load average, versions, and the GPU (and whether it computes bf16)."""
    import platform

    import torch

    machine = describe_machine()
    cuda = torch.cuda.is_available()
    return {
        "cpu": machine["cpu_model"],
        "isa_features": machine["isa_features"],
        "isa_features_from": machine["isa_features_from"],
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_bf16": torch.cuda.is_bf16_supported(including_emulation=False) if cuda else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _child_main(request_path: str, answer_path: str) -> int:
    """Entry point of one isolated run: read the request, run the system, write its result."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    request = json.loads(Path(request_path).read_text())
    workload = Workload(**request["workload"])
    result = run_system(request["system"], workload, request["sources"])
    Path(answer_path).write_text(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
