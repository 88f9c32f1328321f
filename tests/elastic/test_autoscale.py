"""`ps.autoscale`: shards added while training when a shard's rows pass a memory limit.

The decision (`psrec.elastic.autoscale.decide`) against hand-computed cases; and an in-process run
that starts on one shard whose tables outgrow the limit halfway: it grows while it trains and ends
with the model of the same run kept on one shard (the oracle), bit for bit, with every growth in
``summary.json``'s ``resharding``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from psrec.config import ConfigError
from psrec.elastic.autoscale import GIB, AtLimit, Grow, decide
from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config
from tests.elastic.test_scale import SETTINGS, assert_same_tables


def test_the_decision_grows_to_hold_the_rows_at_the_fill_and_stops_at_max_shards() -> None:
    limit = 2 * GIB
    assert (
        decide([int(2 * GIB), int(GIB)], limit_bytes=limit, max_shards=8, fill=0.75) is None
    )  # at, not over
    grow = decide([int(3 * GIB), int(GIB)], limit_bytes=limit, max_shards=8, fill=0.75)
    assert grow == Grow(3, "shard 0 holds 3 GiB of rows, over ps.autoscale.max_shard_memory_gb=2")  # 4/1.5
    grown = decide([int(2.1 * GIB)], limit_bytes=limit, max_shards=8, fill=1.0)
    assert isinstance(grown, Grow) and grown.shards == 2  # at least one more
    capped = decide([int(9 * GIB), int(9 * GIB)], limit_bytes=limit, max_shards=4, fill=0.75)
    assert isinstance(capped, Grow) and capped.shards == 4
    full = decide([int(3 * GIB)] * 4, limit_bytes=limit, max_shards=4, fill=0.75)
    assert isinstance(full, AtLimit) and "ps.autoscale.max_shards=4" in full.reason
    assert decide([], limit_bytes=limit, max_shards=4, fill=0.75) is None


def test_autoscale_settings_are_checked(synthetic_sources: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_shards=1 must be between ps.num_shards=2"):
        small_run_config(
            synthetic_sources, tmp_path, **{"ps.autoscale": {"max_shard_memory_gb": 1, "max_shards": 1}}
        )
    with pytest.raises(ConfigError, match="max_shard_memory_gb"):
        small_run_config(
            synthetic_sources, tmp_path, **{"ps.autoscale": {"max_shard_memory_gb": 0, "max_shards": 4}}
        )


def _run(sources: dict[str, Any], run_dir: Path, autoscale: dict[str, Any] | None) -> tuple[Any, ...]:
    settings = {**SETTINGS, "ps.num_shards": 1, "ps.autoscale": autoscale}
    config = small_run_config(sources, run_dir, **settings)
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train(config, runtime=runtime, resume=False)
        row_bytes = [sum(t["row_bytes"] for t in shard.stats().values()) for shard in runtime.shards]
        return summary, runtime.dense_states()[0], runtime.table_rows(), row_bytes
    finally:
        runtime.shutdown()


def test_a_run_whose_tables_outgrow_one_shard_grows_and_trains_the_one_shard_model(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    oracle_summary, oracle_dense, oracle_rows, (final_bytes,) = _run(
        synthetic_sources, tmp_path / "oracle", None
    )
    limit_gb = final_bytes / 2 / GIB  # passed about halfway through the run
    autoscale = {"max_shard_memory_gb": limit_gb, "max_shards": 4, "fill": 0.75}
    summary, dense, rows, row_bytes = _run(synthetic_sources, tmp_path / "grown", autoscale)
    grown = [entry for entry in summary["resharding"] if entry.get("requested_by") == "ps.autoscale"]
    assert grown and all(entry["state"] == "done" for entry in grown)
    assert "over ps.autoscale.max_shard_memory_gb" in grown[0]["reason"]
    assert 2 <= len(row_bytes) <= 4
    assert max(row_bytes) <= limit_gb * GIB or len(row_bytes) == 4
    for name, value in oracle_dense.items():
        torch.testing.assert_close(dense[name], value, rtol=0, atol=0, msg=name)
    assert_same_tables(rows, oracle_rows)
    assert summary["validation"]["auc"] == oracle_summary["validation"]["auc"]
