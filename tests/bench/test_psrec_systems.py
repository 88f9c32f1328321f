"""psrec's bench systems: the timed window holds everything between the first and last timed step.

Run: `python -m pytest tests/bench/test_psrec_systems.py -q` (a few seconds; no timing asserts beyond
"the sleeps the test injects are on the clock").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from psrec.bench import psrec_systems
from psrec.bench.harness import run_bench
from psrec.bench.psrec_systems import ProgressClock, _timed_rate


def reports(points: list[tuple[int, int, float, float, float]]) -> list[dict[str, Any]]:
    """(epoch, samples, driver's training seconds so far, wall clock, cpu) -> cumulative reports."""
    return [
        {"epoch": e, "step": n // 100, "samples": n, "samples_per_second": n / t, "clock": c, "cpu": u}
        for e, n, t, c, u in points
    ]


def test_timed_rate_counts_wall_clock_between_reports_not_only_training_seconds() -> None:
    # Each chunk trains 1 s (runtime.train_steps) and the driver spends 0.5 s around it.
    timed = _timed_rate(
        reports([(0, 100, 1.0, 10.0, 1.0), (0, 200, 2.0, 11.5, 2.5), (0, 300, 3.0, 13.0, 4.0)]),
        has_warmup=True,
    )
    assert timed["timed_seconds"] == pytest.approx(3.0)
    assert timed["timed_train_steps_seconds"] == pytest.approx(2.0)
    assert timed["samples_per_second"] == pytest.approx(200 / 3.0)
    assert timed["samples_per_cpu_second"] == pytest.approx(200 / 3.0)
    assert timed["best_step_samples_per_second"] == pytest.approx(100 / 1.5)
    assert timed["timed_steps"] == 2


def test_timed_rate_without_warmup_starts_at_the_first_chunk() -> None:
    timed = _timed_rate(reports([(0, 100, 1.0, 10.0, 1.0), (0, 200, 2.0, 11.5, 2.5)]), has_warmup=False)
    assert timed["timed_samples"] == 200 and timed["timed_steps"] == 2
    assert timed["timed_seconds"] == pytest.approx(2.5)  # from 9.0 (10.0 less its 1 s of training)
    assert timed["samples_per_cpu_second"] == pytest.approx(100 / 1.5)  # CPU known after report 1 only


def test_progress_clock_leaves_its_own_bookkeeping_off_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_scan() -> list[int]:
        time.sleep(0.2)  # as reading every actor's /proc entry can take
        return []

    monkeypatch.setattr(psrec_systems, "_actor_pids", slow_scan)
    clock = ProgressClock(actors=True)
    for _ in range(3):
        clock({"samples": 1})
        time.sleep(0.05)
    gaps = [b["clock"] - a["clock"] for a, b in zip(clock.reports, clock.reports[1:], strict=False)]
    assert all(0.04 < gap < 0.15 for gap in gaps), gaps


def test_psrec_timed_window_includes_the_drivers_work_between_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psrec.train.loop

    write_scalars = psrec.train.loop.write_scalars

    def slow_write_scalars(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.2)  # driver work after runtime.train_steps, before the progress report
        write_scalars(*args, **kwargs)

    monkeypatch.setattr(psrec.train.loop, "write_scalars", slow_write_scalars)
    from tests.bench.test_bench import tiny_workload

    workload = tiny_workload(tmp_path / "cache")
    (run,) = run_bench(workload, ["psrec"], rounds=1, isolate=False)["runs"]
    assert run["timed_steps"] == 2
    # Two timed chunks of one step, each followed by 0.2 s of driver work before its report.
    assert run["timed_seconds"] - run["timed_train_steps_seconds"] >= 0.35
    assert run["samples_per_second"] <= run["timed_samples"] / 0.4


class _StopBeforeStarting(Exception):
    pass


def test_the_bench_starts_ray_as_psrec_train_does_on_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ray bench run must not start a cluster listening on every interface: it goes through
    `start_ray(None)` (node address 127.0.0.1 in Ray's single-machine mode, token authentication),
    and starts its actors' processes as `psrec train` does: all at once, and no idle workers (which
    would take CPU from the timed run)."""
    import ray
    from ray._private import ray_constants

    from psrec.bench.psrec_systems import PsrecLayout, bench_config, run_psrec
    from psrec.cluster.start import _actor_start_settings, ray_start_arguments
    from psrec.config import parse_config
    from tests.bench.test_bench import tiny_workload

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already running in this process")
    seen: dict[str, object] = {}

    def fake_init(**kwargs: object) -> None:
        seen.update(
            kwargs,
            single_machine=not ray_constants.ENABLE_RAY_CLUSTER,
            auth=os.environ.get("RAY_AUTH_MODE"),
            actor_start={name: os.environ.get(name) for name in trains_with},
        )
        raise _StopBeforeStarting

    layout = PsrecLayout("ray")
    workload = tiny_workload(tmp_path)
    config = parse_config(bench_config(workload, str(tmp_path / "run"), layout))
    trains_with = _actor_start_settings(ray_start_arguments(config)["actors"], 4)
    for name in trains_with:
        monkeypatch.delenv(name, raising=False)  # start_ray sets them in this process's environment
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(_StopBeforeStarting):
        run_psrec(workload, {}, layout=layout)
    assert seen["actor_start"] == trains_with
    assert seen["_node_ip_address"] == "127.0.0.1"
    assert seen["single_machine"] is True  # else Ray swaps 127.0.0.1 for the host's address
    assert seen["auth"] == "token"


def test_a_layout_on_several_nodes_spreads_trainers_and_shards_by_node_resources() -> None:
    from psrec.bench.psrec_systems import SHARD_RESOURCE, TRAINER_RESOURCE, PsrecLayout, bench_config
    from psrec.config import parse_config
    from tests.bench.test_bench import tiny_workload

    layout = PsrecLayout("ray", num_trainers=3, num_shards=2, nodes=2)
    # 3 trainers on 2 nodes: 2 units per node; 2 shards: 1 per node
    assert layout.node_resources() == {TRAINER_RESOURCE: 2.0, SHARD_RESOURCE: 1.0}
    workload = tiny_workload(Path("/nonexistent"))
    config = parse_config(bench_config(workload, "run", layout, address="127.0.0.1:6379"), source="<test>")
    assert config.ps.address == "127.0.0.1:6379"
    placement = config.ps.placement
    assert (placement.shards, placement.trainers) == ("spread", "spread")
    assert (placement.shard_node_resource, placement.trainer_node_resource) == (
        SHARD_RESOURCE,
        TRAINER_RESOURCE,
    )
    one_node = parse_config(bench_config(workload, "run", PsrecLayout("ray")), source="<test>")
    assert one_node.ps.address is None and one_node.ps.placement.shard_node_resource is None


def test_the_profile_names_the_nodes_of_a_layout_that_spans_them() -> None:
    from psrec.bench.cli import format_profile

    profile = {"total": 10.0}
    placement = {
        "nodes_alive": 2,
        "nodes_used": 2,
        "shards": [{"index": 0, "node_ip": "127.0.0.1", "node_id": "aaaaaaaaaa"}],
        "trainers": [{"index": 0, "node_ip": "127.0.0.1", "node_id": "bbbbbbbbbb"}],
    }
    row = {"system": "psrec-ray-2x2-nodes", "profile": profile, "placement": placement}
    row.update(bytes_pulled_per_sample=1.0, bytes_pushed_per_sample=1.0)
    text = format_profile({"rows": [row]})
    assert (
        "psrec-ray-2x2-nodes: placement on 2 of 2 nodes: 127.0.0.1/aaaaaaaa: shard 0; 127.0.0.1/bbbbbbbb: trainer 0"
        in text
    )


@pytest.mark.slow
@pytest.mark.ray
def test_the_two_node_layout_runs_one_trainer_and_one_shard_on_each_node(tmp_path: Path) -> None:
    """`psrec-ray-2x2-nodes` starts its own two-node cluster (about 30 s here), trains, stops it."""
    import ray

    from psrec.bench.harness import run_system
    from tests.bench.test_bench import tiny_workload

    if ray.is_initialized():
        ray.shutdown()
    result = run_system("psrec-ray-2x2-nodes", tiny_workload(tmp_path / "cache"), {})
    assert "error" not in result, result.get("error")
    placement = result["placement"]
    assert placement["nodes_alive"] == 2 and placement["nodes_used"] == 2
    assert placement["trainer_nodes"] == 2 and placement["shard_nodes"] == 2
    assert result["samples_per_second"] > 0 and result["samples_per_cpu_second"] > 0
    assert result["bytes_pulled_per_sample"] > 0 and result["bytes_pushed_per_sample"] > 0
    assert not ray.is_initialized()


def test_timed_rate_gives_ray_daemons_cpu_per_timed_sample() -> None:
    points = reports([(0, 100, 1.0, 10.0, 1.0), (0, 300, 3.0, 12.0, 3.0)])
    points[0]["ray_daemons_cpu"], points[1]["ray_daemons_cpu"] = 5.0, 5.5
    timed = _timed_rate(points, has_warmup=True)
    assert timed["ray_daemons_cpu_seconds_per_sample"] == pytest.approx(0.5 / 200)
    assert "ray_daemons_cpu_seconds_per_sample" not in _timed_rate(reports([(0, 100, 1.0, 10.0, 1.0)]), True)
