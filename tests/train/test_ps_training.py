"""End-to-end PS training: in-process learns; Ray sync with 2 trainers equals the single-process oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.config import ConfigError, RunConfig, parse_config
from psrec.data.batch import concat_batches
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.ps.client import LocalConnection, linear_table_name
from psrec.ps.shard import ParameterShard
from psrec.train.loop import train
from psrec.trainer import builders
from psrec.trainer.lookup import batch_lookup
from psrec.trainer.step import StepRunner
from tests.conftest import small_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(synthetic_sources: dict[str, Any]) -> dict[str, Any]:
    return synthetic_sources


def make_config(sources: dict[str, Any], run_dir: Path, **overrides: Any) -> RunConfig:
    return small_run_config(sources, run_dir, **overrides)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_in_process_training_learns(dataset: dict[str, Any], tmp_path: Path, precision: str) -> None:
    config = make_config(dataset, tmp_path, **{"training.dense_precision": precision})
    summary = train(config)
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == 24_000
    assert summary["validation"]["auc"] > 0.65, summary["validation"]
    assert (tmp_path / "summary.json").exists()
    assert summary["tables"]["C1"]["rows"] > 0


def test_cached_data_trains_exactly_like_reading_every_epoch(dataset: dict[str, Any], tmp_path: Path) -> None:
    """training.cache_data: epochs 2+ come from memory; the run is the same, step for step."""
    options = {"training.epochs": 2, "training.shuffle_buffer": 5000}
    plain = train(make_config(dataset, tmp_path / "plain", **options))
    cached = train(make_config(dataset, tmp_path / "cached", **options, **{"training.cache_data": True}))
    assert cached["rows_consumed"] == plain["rows_consumed"] == 2 * 24_000
    assert cached["steps"] == plain["steps"]
    assert cached["validation"] == plain["validation"]
    assert cached["tables"] == plain["tables"]


def _oracle(config: RunConfig, sources: dict[str, Any], steps: int) -> tuple[dict[str, Any], Any]:
    """One in-process trainer fed, at step k, the union of both trainers' k-th batches (batch 2b)."""
    torch.manual_seed(config.training.seed)
    shards = [ParameterShard(0, builders.build_tables(config))]
    model = builders.build_model_for(config)
    client = batch_lookup(
        [LocalConnection(shards[0])],
        np.zeros(config.ps.num_buckets, dtype=np.int64),
        table_dims={n: s.dim for n, s in builders.table_specs(config).items()},
        feature_tables=builders.feature_tables(config),
    )
    runner = StepRunner(model, builders.build_dense_optimizer(config, model), client)
    readers = [
        open_reader(
            DataSource.model_validate(sources["train"]),
            config.feature_schema(),
            batch_size=config.training.batch_size,
            shard=i,
            num_shards=2,
            seed=config.training.seed * 1000,
        )
        for i in range(2)
    ]
    batches = (concat_batches(list(pair)) for pair in zip(*readers, strict=False))
    list(runner.run(batches, first_step=0, max_steps=steps))
    for reader in readers:
        reader.close()
    return model.state_dict(), shards[0].table_rows()


@pytest.mark.ray
def test_ray_sync_two_trainers_equal_single_trainer_oracle(
    ray_cluster: None, dataset: dict[str, Any], tmp_path: Path
) -> None:
    from psrec.train.runtime import RayRuntime

    config = make_config(
        dataset,
        tmp_path,
        # embedding L2 too: applied once per touched row and step by the shards, whatever the trainer count
        **{
            "ps.runtime": "ray",
            "ps.num_trainers": 2,
            "ps.shard_resources": {"num_cpus": 0.5},
            "training.embedding_l2": 0.05,
        },
    )
    steps = 6
    runtime = RayRuntime(config, base_dir=".", data_sources=dataset)
    try:
        runtime.start_epoch(0)
        results = runtime.train_steps(steps)
        dense = runtime.dense_states()
        rows = runtime.table_rows()
    finally:
        runtime.shutdown()
    assert [r.steps for r in results] == [steps, steps]
    oracle_dense, oracle_rows = _oracle(config, dataset, steps)
    for name, value in oracle_dense.items():
        torch.testing.assert_close(dense[0][name], value, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dense[1][name], value, rtol=1e-4, atol=1e-5)
    assert set(rows) == set(oracle_rows)
    for table, (ids, values) in oracle_rows.items():
        np.testing.assert_array_equal(rows[table][0], ids)
        np.testing.assert_allclose(rows[table][1], values, rtol=1e-4, atol=1e-5)


@pytest.mark.ray
def test_ray_async_trains_and_leaves_no_processes(
    ray_cluster: None, dataset: dict[str, Any], tmp_path: Path
) -> None:
    import os

    import ray

    from psrec.train.runtime import RayRuntime

    config = make_config(dataset, tmp_path, **{"ps.runtime": "ray", "ps.mode": "async", "ps.staleness": 2})
    runtime = RayRuntime(config, base_dir=".", data_sources=dataset)
    pids = ray.get([a.pid.remote() for a in [*runtime.shards, *runtime.trainers]])
    summary = train(config, runtime=runtime)
    runtime.shutdown()
    assert summary["rows_consumed_unique"] == 24_000
    assert summary["validation"]["auc"] > 0.65
    for _ in range(50):
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            break
        import time

        time.sleep(0.1)
    assert not alive, f"actor processes still alive: {alive}"
    del os


@pytest.mark.ray
def test_fp16_wire_trains_like_fp32_with_about_half_the_bytes(
    ray_cluster: None, dataset: dict[str, Any], tmp_path: Path
) -> None:
    summaries = {
        wire: train(make_config(dataset, tmp_path / wire, **{"ps.runtime": "ray", "ps.wire_precision": wire}))
        for wire in ("fp32", "fp16")
    }
    fp32, fp16 = summaries["fp32"], summaries["fp16"]
    assert fp16["rows_consumed_unique"] == 24_000
    assert fp16["validation"]["auc"] == pytest.approx(fp32["validation"]["auc"], abs=0.005)
    # rows: 4 fp32 values -> 4 fp16 (half); gradients: half plus a 4-byte scale per row; ids unchanged
    assert fp16["bytes_pulled_per_sample"] == pytest.approx(fp32["bytes_pulled_per_sample"] / 2, rel=0.01)
    assert fp16["bytes_pushed_per_sample"] < 0.9 * fp32["bytes_pushed_per_sample"]


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_config_errors_fail_before_training(tmp_path: Path) -> None:
    base = {"data": {"synthetic": {}}, "model": {"name": "dlrm"}}
    with pytest.raises(ConfigError, match="model"):
        parse_config({**base, "model": {"name": "transformer9000"}})
    with pytest.raises(ConfigError, match="num_buckets"):
        parse_config({**base, "ps": {"num_shards": 8, "num_buckets": 4}})
    with pytest.raises(ConfigError, match="tables"):
        parse_config({**base, "embedding": {"default": None, "tables": {"C1": {"dim": 4}}}})


def test_unreachable_ray_address_fails_fast() -> None:
    import socket
    import time

    from psrec.cluster.start import check_reachable

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="does not answer"):
        check_reachable(f"127.0.0.1:{port}", timeout=1.0)
    assert time.perf_counter() - start < 5
    with pytest.raises(ConfigError, match="HOST:PORT"):
        check_reachable("not-an-address")


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_trainers_with_uneven_shares_consume_every_row_once(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    """13 row groups dealt to 2 trainers (7 + 6): the trainer that runs out keeps stepping emptily."""
    from psrec.data.synth import write_synthetic_criteo

    root = tmp_path_factory.mktemp("uneven")
    write_synthetic_criteo(root / "train", rows=13 * 512, seed=3, cardinality_scale=0.002, row_group_rows=512)
    sources = {"train": {"format": "parquet", "paths": [str(root / "train" / "*.parquet")]}}
    config = make_config(
        sources,
        root / "run",
        **{"ps.runtime": "ray", "ps.num_trainers": 2, "ps.mode": mode, "training.batch_size": 128},
    )
    summary = train(config)
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == 13 * 512
    assert summary["steps"] == 28  # the larger share: 7 row groups of 4 batches


@pytest.mark.ray
@pytest.mark.parametrize(
    "sharding",
    [  # "auto" shards C3 row-wise and the other tables table-wise: both ways in the default suite
        pytest.param("row_wise", marks=pytest.mark.slow),
        pytest.param("table_wise", marks=pytest.mark.slow),
        "auto",
    ],
)
def test_collective_strategy_equals_parameter_server(
    ray_cluster: None, dataset: dict[str, Any], tmp_path: Path, sharding: str
) -> None:
    """strategy: collective (tables sharded across 2 trainers, all-to-all) trains like the PS in sync mode."""
    from psrec.train.runtime import RayRuntime

    results = {}
    for strategy in ("ps", "collective"):
        config = make_config(
            dataset,
            tmp_path / strategy,
            **{"ps.runtime": "ray", "ps.num_trainers": 2, "ps.strategy": strategy, "ps.sharding": sharding},
            **(_SIZED if sharding == "auto" else {}),
        )
        runtime = RayRuntime(config, base_dir=".", data_sources=dataset)
        try:
            runtime.start_epoch(0)
            runtime.train_steps(5)
            results[strategy] = (
                runtime.dense_states()[0],
                runtime.table_rows(),
                runtime.evaluate("validation"),
            )
        finally:
            runtime.shutdown()
    (ps_dense, ps_rows, ps_eval), (co_dense, co_rows, co_eval) = results["ps"], results["collective"]
    for name, value in ps_dense.items():
        torch.testing.assert_close(co_dense[name], value, rtol=1e-4, atol=1e-5)
    for table, (ids, values) in ps_rows.items():
        np.testing.assert_array_equal(co_rows[table][0], ids)
        np.testing.assert_allclose(co_rows[table][1], values, rtol=1e-4, atol=1e-5)
    assert co_eval["scores"].size == ps_eval["scores"].size == 6_000


_SIZED = {  # expected sizes for sharding "auto": C3 outweighs an even share, the others do not
    "embedding.default.expected_rows": 100,
    "embedding.tables.C3": {
        "dim": 4,
        "optimizer": {"name": "rowwise_adagrad", "lr": 0.1},
        "expected_rows": 10**6,
    },
}


def test_reserved_tables_are_populated_unless_the_config_says_not(
    dataset: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psrec.embedding import table as table_module

    populated: list[int] = []
    monkeypatch.setattr(table_module, "populate", lambda array: populated.append(array.nbytes))
    builders.build_tables(make_config(dataset, tmp_path, **{"embedding.default.expected_rows": 1000}))
    assert len(populated) >= 26 * 5  # every table's payload, state, metadata, ids and index
    populated.clear()
    lazy = {"embedding.default.expected_rows": 1000, "embedding.default.populate": False}
    builders.build_tables(make_config(dataset, tmp_path, **lazy))
    assert populated == []


def test_collective_placement_follows_the_planner(dataset: dict[str, Any], tmp_path: Path) -> None:
    config = make_config(
        dataset,
        tmp_path,
        **{"ps.runtime": "ray", "ps.num_trainers": 2, "ps.strategy": "collective"},
        **_SIZED,
    )
    row_wise = builders.collective_placement(config, 2)
    assert row_wise.owner_of("C3") is None and row_wise.owner_of("C1") is None
    auto = builders.collective_placement(
        config.model_copy(update={"ps": config.ps.model_copy(update={"sharding": "auto"})}), 2
    )
    assert auto.owner_of("C3") is None  # too large for one trainer's even share: split by bucket
    owners = [auto.owner_of(f"C{i}") for i in range(1, 27) if i != 3]
    assert set(owners) == {0, 1} and abs(owners.count(0) - owners.count(1)) <= 1  # small ones packed
    table_wise = builders.collective_placement(
        config.model_copy(update={"ps": config.ps.model_copy(update={"sharding": "table_wise"})}), 2
    )
    assert table_wise.owner_of("C3") in (0, 1)


def test_collective_auto_sharding_needs_sizes_and_memory(dataset: dict[str, Any], tmp_path: Path) -> None:
    collective = {
        "ps.runtime": "ray",
        "ps.num_trainers": 2,
        "ps.strategy": "collective",
        "ps.sharding": "auto",
    }
    with pytest.raises(ConfigError, match="expected_rows"):
        make_config(dataset, tmp_path, **collective)
    tight = make_config(
        dataset, tmp_path, **collective, **_SIZED, **{"ps.trainer_resources.memory_gb": 0.001}
    )
    with pytest.raises(ConfigError, match="ps.sharding 'auto'"):
        builders.collective_placement(tight, 2)


def test_profile_table_lists_phases_by_share() -> None:
    from psrec.train.cli import format_profile

    text = format_profile(
        {"steps": 10, "phase_seconds": {"forward": 1.0, "backward": 3.0, "plan_overlapped": 0.5}}
    )
    lines = text.splitlines()
    assert lines[1].startswith("backward") and "75.0%" in lines[1]
    assert lines[2].startswith("forward") and "100.00" in lines[2]  # 1 s over 10 steps = 100 ms/step
    assert lines[3].startswith("total") and "4.00" in lines[3]  # overlapped work is not added
    assert lines[4].startswith("plan_overlapped") and "in parallel" in lines[4]


@pytest.mark.ray
def test_ray_single_trainer_sync_equals_in_process(
    ray_cluster: None, dataset: dict[str, Any], tmp_path: Path
) -> None:
    """One trainer does not wait for push acknowledgements; Ray's per-caller ordering keeps it exact."""
    from psrec.train.runtime import LocalRuntime, RayRuntime

    states, settings = {}, {}
    for runtime_name, runtime_class in (("local", LocalRuntime), ("ray", RayRuntime)):
        config = make_config(dataset, tmp_path / runtime_name, **{"ps.runtime": runtime_name})
        runtime = runtime_class(config, base_dir=".", data_sources=dataset)
        try:
            runtime.start_epoch(0)
            runtime.train_steps(8)
            states[runtime_name] = (runtime.dense_states()[0], runtime.table_rows())
            settings[runtime_name] = runtime.compute_settings()[0]
        finally:
            runtime.shutdown()
    # MKL's GEMMs sum in an order that depends on their thread count on some CPUs (Intel's) and not
    # on others, and ATen's kernels differ by instruction set: the bits below can match on this
    # machine and differ on a user's unless both trainers computed with the configured thread counts
    # and the same dispatch, so those are checked on every machine
    threads = config.ps.trainer_resources.threads  # 1: below a default of one per core
    expected = {**dict.fromkeys(("torch", "openmp", "mkl", "numba"), threads)}
    expected["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the test process's
    assert settings == {"local": expected, "ray": expected}
    (local_dense, local_rows), (ray_dense, ray_rows) = states["local"], states["ray"]
    for name, value in local_dense.items():
        torch.testing.assert_close(ray_dense[name], value, rtol=0, atol=0)
    for table, (ids, values) in local_rows.items():
        np.testing.assert_array_equal(ray_rows[table][0], ids)
        np.testing.assert_array_equal(ray_rows[table][1], values)


@pytest.mark.parametrize(
    "instructions",
    [
        pytest.param({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, id="avx2"),
        pytest.param(
            {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
            id="default",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_ray_equals_in_process_on_a_cpu_with_fewer_instructions(instructions: dict[str, str]) -> None:
    """`test_ray_single_trainer_sync_equals_in_process` with torch's kernels dispatched as on a CPU
    without AVX-512 (avx2) or without AVX (default), in a fresh test process and Ray cluster that
    both take the setting from the environment: exactness must not rest on this machine's kernels."""
    test = f"{Path(__file__).relative_to(ROOT)}::test_ray_single_trainer_sync_equals_in_process"
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=ROOT,
        env={**os.environ, **instructions},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    assert "1 passed" in completed.stdout


def test_embedding_l2_becomes_the_embedding_tables_weight_decay_not_the_linear_ones(
    dataset: dict[str, Any], tmp_path: Path
) -> None:
    config = make_config(
        dataset, tmp_path, **{"model": {"name": "deepfm", "hidden_sizes": [8]}, "training.embedding_l2": 0.3}
    )
    specs = builders.table_specs(config)
    linear = {name for name in specs if name.endswith(linear_table_name(""))}
    assert linear and len(linear) * 2 == len(specs)
    for name, spec in specs.items():
        assert spec.optimizer.weight_decay == (0.0 if name in linear else 0.3), name
