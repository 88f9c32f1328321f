"""A checkpoint written with N shards restores into M shards, and training goes on exactly.

The resharded run trains 20 steps on 2 shards, resumes on 3 shards to step 30, then on 1 shard to
step 40, through a chain whose checkpoints were written by all three layouts. The oracle is the same
run resumed at the same steps on 2 shards throughout (rows start from a function of (seed, id), so
in sync mode any shard count trains the same model): every table row and dense weight must be equal.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.checkpoint import list_checkpoints, read_manifest
from psrec.ps.reshard import arrays_for_shard
from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config

SETTINGS = {"checkpoint.every_steps": 10, "checkpoint.full_every": 10, "training.log_every_steps": 5}


def run(
    sources: dict[str, Any], run_dir: Path, *, shards: int, steps: int
) -> tuple[dict[str, Any], Any, Any]:
    sources = {"train": sources["train"]}  # no evaluation: only the trained model is compared
    config = small_run_config(
        sources, run_dir, **SETTINGS, **{"ps.num_shards": shards, "training.max_steps": steps}
    )
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train(config, runtime=runtime, resume=None)
        return summary, runtime.dense_states()[0], runtime.table_rows()
    finally:
        runtime.shutdown()


def assert_same_model(got: tuple[Any, ...], expected: tuple[Any, ...]) -> None:
    (_, got_dense, got_rows), (_, dense, rows) = got, expected
    for name, value in dense.items():
        torch.testing.assert_close(got_dense[name], value, rtol=0, atol=0, msg=name)
    assert got_rows.keys() == rows.keys()
    for table, (ids, values) in rows.items():
        np.testing.assert_array_equal(got_rows[table][0], ids, err_msg=table)
        np.testing.assert_array_equal(got_rows[table][1], values, err_msg=table)


def resumed(sources: dict[str, Any], tmp_path: Path, layouts: list[int]) -> dict[str, tuple[Any, ...]]:
    """20 steps on 2 shards, then resumed 10 steps at a time on each of `layouts`, and the same run
    resumed at the same steps on 2 shards throughout (the oracle); both runs' final models."""
    first = tmp_path / "first"
    run(sources, first, shards=2, steps=20)
    (first / "summary.json").unlink()  # an interrupted run: resumed in place
    finished = {}
    for name, shard_counts in (("same", [2] * len(layouts)), ("resharded", layouts)):
        shutil.copytree(first, tmp_path / name)
        for index, shards in enumerate(shard_counts):
            if index:
                (tmp_path / name / "summary.json").unlink()
            finished[name] = run(sources, tmp_path / name, shards=shards, steps=30 + 10 * index)
    return finished


def test_a_checkpoint_of_2_shards_resumes_on_3_exactly(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    finished = resumed(synthetic_sources, tmp_path, [3])
    assert finished["resharded"][0]["steps"] == 30
    assert_same_model(finished["resharded"], finished["same"])


@pytest.mark.slow
def test_a_chain_written_by_2_then_3_shards_resumes_on_1_shard_exactly(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    finished = resumed(synthetic_sources, tmp_path, [3, 1])
    written = {len(read_manifest(ref)["shards"]) for ref in list_checkpoints(tmp_path / "resharded")}
    assert written == {1, 2, 3}
    assert finished["resharded"][0]["steps"] == 40
    assert_same_model(finished["resharded"], finished["same"])


def test_merging_keeps_each_owned_row_once_and_combines_the_counters() -> None:
    def shard_file(ids: list[int], clock: int, counter: int, sketch: int) -> dict[str, np.ndarray]:
        n = len(ids)
        return {
            "t/config": np.array(f'{{"clock": {clock}, "admission_pull_counter": {counter}, "dim": 2}}'),
            "t/ids": np.array(ids, np.int64),
            "t/rows": np.arange(2 * n, dtype=np.float32).reshape(n, 2) + ids[0] * 10,
            "t/counts": np.ones(n, np.uint32),
            "t/last_step": np.full(n, clock, np.uint32),
            "t/optimizer_state/sum": np.array(ids, np.float32),
            "t/admission_sketch": np.full((1, 3), sketch, np.uint32),
        }

    old = [shard_file([8, 2, 5], 7, 3, 1), shard_file([4, 1], 9, 2, 2**32 - 2)]
    merged = arrays_for_shard(old, owns=lambda ids: ids % 2 == 0)  # even ids belong to this shard
    np.testing.assert_array_equal(merged["t/ids"], [2, 4, 8])
    np.testing.assert_array_equal(merged["t/optimizer_state/sum"], [2, 4, 8])
    np.testing.assert_array_equal(merged["t/rows"][2], old[0]["t/rows"][0])  # id 8's row moved whole
    np.testing.assert_array_equal(merged["t/admission_sketch"], [[2**32 - 1] * 3])  # saturating sum
    config = str(merged["t/config"][()])
    assert '"clock": 9' in config and '"admission_pull_counter": 5' in config
    with pytest.raises(ValueError, match="old shard 1 has fields"):
        arrays_for_shard([old[0], {k: v for k, v in old[1].items() if k != "t/counts"}], owns=lambda i: i > 0)
