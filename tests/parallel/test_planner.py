"""The sharding planner (pure, no processes) and `psrec plan`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psrec.cli import main
from psrec.embedding import EmbeddingTable, SparseOptimizerSpec
from psrec.parallel.plan_spec import PlanSpecError, load_plan_spec, parse_plan_spec
from psrec.parallel.planner import (
    GB,
    Devices,
    PlanDoesNotFit,
    TableSize,
    Workload,
    plan_sharding,
    row_bytes,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan_criteo_terabyte.yaml"


@pytest.mark.parametrize(
    ("dim", "precision", "optimizer"),
    [(16, "fp32", "rowwise_adagrad"), (64, "fp16", "adam"), (32, "int8", "sgd"), (8, "fp32", "ftrl")],
)
def test_row_bytes_bounds_the_engine_memory(dim: int, precision: str, optimizer: str) -> None:
    rows = 20_000
    table = EmbeddingTable("t", dim, optimizer=SparseOptimizerSpec(name=optimizer), precision=precision)
    for start in range(0, rows, 1000):  # grow step by step, like training does
        table.pull(np.arange(start, start + 1000, dtype=np.int64))
    actual = table.memory_bytes()["total"] / rows
    estimate = row_bytes(dim, precision, optimizer)
    assert 0.8 * estimate <= actual <= estimate


def _tables(*rows: int, dim: int = 8) -> list[TableSize]:
    return [TableSize(f"t{i}", rows=r, dim=dim) for i, r in enumerate(rows)]


def test_table_wise_places_every_table_once_largest_first_on_the_emptiest_device() -> None:
    tables = _tables(1000, 900, 500, 400, 100)
    plan = plan_sharding(tables, Devices(2, 10**9), sharding="table_wise")
    owners = plan.owners()
    assert owners == {"t0": 0, "t1": 1, "t2": 1, "t3": 0, "t4": 0}  # 1000|900, 500->1, 400->0, tie->0
    assert sum(plan.memory_bytes) == pytest.approx(sum(t.bytes for t in tables))
    assert all(p.kind == "table_wise" for p in plan.tables)


def test_row_wise_splits_every_table_by_bucket_share() -> None:
    tables = _tables(10_000, 3_000)
    plan = plan_sharding(tables, Devices(3, 10**9), sharding="row_wise", num_buckets=9)
    assert all(p.owner is None for p in plan.tables)
    np.testing.assert_allclose(plan.memory_bytes, [sum(t.bytes for t in tables) / 3] * 3)
    assert plan.bucket_map().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_auto_shards_only_the_tables_that_would_unbalance_a_device() -> None:
    tables = _tables(1_000_000, 10, 20, 30)
    plan = plan_sharding(tables, Devices(4, 10**9), sharding="auto")
    assert plan.owners()["t0"] is None
    assert all(plan.owners()[f"t{i}"] is not None for i in (1, 2, 3))


def test_ps_strategy_is_row_wise_and_reports_trainer_traffic() -> None:
    plan = plan_sharding(
        _tables(5000), Devices(2, 10**9), strategy="ps", workload=Workload(batch_size=100, num_trainers=3)
    )
    assert plan.sharding == "row_wise" and plan.trainer_traffic is not None
    # per trainer: 100 ids of dim 8: out 8 (pull id) + 8 + 32 (push id and gradient), back 32 bytes each
    assert plan.trainer_traffic.sent_bytes == pytest.approx(100 * 48)
    assert plan.trainer_traffic.received_bytes == pytest.approx(100 * 32)
    assert sum(t.received_bytes for t in plan.traffic) == pytest.approx(3 * 100 * 48)


def test_collective_traffic_one_device_is_free_and_table_wise_owner_serves_the_others() -> None:
    single = plan_sharding(_tables(5000), Devices(1, 10**9), workload=Workload(batch_size=100))
    assert single.traffic[0].sent_bytes == single.traffic[0].received_bytes == 0
    plan = plan_sharding(
        _tables(5000), Devices(2, 10**9), sharding="table_wise", workload=Workload(batch_size=100)
    )
    owner = plan.owners()["t0"]
    assert owner is not None
    other = 1 - owner
    assert plan.traffic[other].sent_bytes == pytest.approx(100 * 48)  # its ids out, gradients out
    assert plan.traffic[owner].received_bytes == pytest.approx(100 * 48)
    assert plan.traffic[owner].sent_bytes == plan.traffic[other].received_bytes == pytest.approx(100 * 32)


def test_refusal_names_the_device_and_the_shortfall() -> None:
    tables = _tables(10_000_000, 10_000_000, dim=64)  # 2 x 3.18 GB
    with pytest.raises(PlanDoesNotFit, match=r"device 0 would hold .* short by") as error:
        plan_sharding(tables, Devices(2, 2 * GB, headroom=0.0), sharding="row_wise")
    assert error.value.minimum_devices == 4  # 6.37 GB over 2 GB devices
    assert error.value.shortfall_bytes == pytest.approx(sum(t.bytes for t in tables) / 2 - 2 * GB)
    with pytest.raises(PlanDoesNotFit, match=r"table t0 .* short by .* row-wise"):
        plan_sharding(tables, Devices(4, 2 * GB, headroom=0.0), sharding="table_wise")


def test_bad_inputs_are_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="strategy"):
        plan_sharding(_tables(1), Devices(1, 10), strategy="magic")
    with pytest.raises(ValueError, match="repeat"):
        plan_sharding(_tables(1) + _tables(2), Devices(1, 10))
    with pytest.raises(ValueError, match="precision"):
        TableSize("x", rows=1, dim=4, precision="fp8")


def test_criteo_terabyte_fits_8_by_80_gb_and_is_refused_for_2_by_16_gb() -> None:
    spec = load_plan_spec(EXAMPLE)
    assert len(spec.tables) == 26 and max(e.rows for e in spec.tables.values()) <= 40_000_000
    plan = plan_sharding(**spec.inputs())
    assert max(plan.memory_bytes) < 80 * GB * 0.9
    assert sum(plan.memory_bytes) > 100 * GB  # it really is big
    small = load_plan_spec(EXAMPLE, overrides={"devices.count": 2, "devices.memory_gb": 16})
    with pytest.raises(PlanDoesNotFit, match="short by") as error:
        plan_sharding(**small.inputs())
    assert error.value.minimum_devices == 8


def test_plan_spec_errors_name_the_field() -> None:
    with pytest.raises(PlanSpecError, match=r"tables\.C1\.rows"):
        parse_plan_spec({"devices": {"count": 1, "memory_gb": 1}, "tables": {"C1": {"rows": -1}}})
    with pytest.raises(PlanSpecError, match="devices"):
        parse_plan_spec({"tables": {"C1": 3}})
    spec = parse_plan_spec(
        {"devices": {"count": 1, "memory_gb": 1}, "tables": {"C1": 3, "C2": {"rows": 4, "dim": 2}}}
    )
    assert [(t.rows, t.dim) for t in spec.table_sizes()] == [(3, 16), (4, 2)]


def test_psrec_plan_prints_a_placement_or_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "row-wise over 8 devices" in out and "table-wise on device" in out and "C26" in out
    assert main(["plan", str(EXAMPLE), "--devices", "2", "--memory-gb", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refused: does not fit: device 0") and "at least 8 devices" in err
    assert main(["plan", str(EXAMPLE), "--strategy", "ps", "--devices", "4", "--json"]) == 0
    assert '"strategy": "ps"' in capsys.readouterr().out
