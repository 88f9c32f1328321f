"""The planner with disk tiers: memory and disk counted apart, and `plan_disk_tier` choosing how many
rows of each table stay in memory so that a plan that does not fit in memory does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psrec.cli import main
from psrec.embedding.disk_tier import RecordLayout
from psrec.parallel.plan_spec import parse_plan_spec
from psrec.parallel.planner import (
    GB,
    Devices,
    PlanDoesNotFit,
    TableSize,
    plan_disk_tier,
    plan_sharding,
    row_bytes,
)
from psrec.ps.routing import default_bucket_map

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan_criteo_terabyte.yaml"
TABLES = [TableSize("big", rows=50_000_000, dim=64), TableSize("mid", rows=2_000_000, dim=64)]
TABLES.append(TableSize("small", rows=1000, dim=64))


def test_memory_and_disk_are_counted_apart():
    table = TableSize("t", rows=1_000_000, dim=64, optimizer="adam", memory_rows=100_000)
    record = RecordLayout(64, precision="fp32", optimizer="adam").record_bytes
    # every row has up to 1.25 / 0.5 slots once any is on disk (the log's garbage included)
    assert table.disk_bytes == pytest.approx(1_000_000 * record * 1.25 / 0.5)
    # a cold row: 5 / 0.85 index bytes at 1.2x growth, id + [count, last step] + slot at 1.0625x
    assert table.bytes == pytest.approx(100_000 * row_bytes(64, "fp32", "adam") + 900_000 * 28.31, rel=1e-3)
    plan = plan_sharding([table], Devices(2, 10 * GB), strategy="ps", num_buckets=64)
    shares = np.bincount(default_bucket_map(64, 2), minlength=2) / 64
    assert plan.disk_bytes == pytest.approx(tuple(shares * table.disk_bytes))
    assert plan.memory_bytes == pytest.approx(tuple(shares * table.bytes))


def test_disk_tier_plan_fits_what_memory_alone_cannot():
    devices = Devices(4, 4 * GB)
    with pytest.raises(PlanDoesNotFit):
        plan_sharding(TABLES, devices, strategy="ps")
    planned = {t.name: t for t in plan_disk_tier(TABLES, devices)}
    assert planned["small"].memory_rows is None and planned["mid"].memory_rows is None  # whole
    assert 0 < planned["big"].memory_rows < 50_000_000
    plan = plan_sharding(list(planned.values()), devices, strategy="ps")
    assert max(plan.memory_bytes) <= devices.usable_bytes
    assert max(plan.memory_bytes) > 0.999 * devices.usable_bytes  # as much in memory as fits
    assert sum(plan.disk_bytes) == pytest.approx(planned["big"].disk_bytes)


def test_tables_that_fit_are_left_alone_and_too_little_memory_is_refused():
    devices = Devices(4, 100 * GB)
    assert plan_disk_tier(TABLES, devices) == TABLES
    with pytest.raises(PlanDoesNotFit, match="does not fit even with a disk tier: the disk index"):
        plan_disk_tier(TABLES, Devices(1, GB // 4))


def test_disk_too_small_is_refused_naming_the_device():
    table = TableSize("t", rows=10_000_000, dim=64, memory_rows=1_000_000)
    with pytest.raises(PlanDoesNotFit, match="device 0 would hold .* of disk-tier rows but has 1.00 GB"):
        plan_sharding([table], Devices(1, 64 * GB, disk_bytes=GB), strategy="ps")


def test_plan_file_fields_and_cli(capsys):
    spec = parse_plan_spec(
        {
            "devices": {"count": 2, "memory_gb": 16, "disk_gb": 500},
            "tables": {"a": {"rows": 100, "memory_rows": 10}},
        }
    )
    inputs = spec.inputs()
    assert inputs["tables"][0].memory_rows == 10 and inputs["devices"].disk_bytes == 500 * GB
    assert main(["plan", str(EXAMPLE), "--devices", "2", "--memory-gb", "16", "--strategy", "ps"]) == 2
    capsys.readouterr()
    assert (
        main(["plan", str(EXAMPLE), "--devices", "2", "--memory-gb", "16", "--strategy", "ps", "--disk-tier"])
        == 0
    )
    out = capsys.readouterr().out
    assert "on disk" in out and "storage.memory_rows:" in out
