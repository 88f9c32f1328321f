"""Eviction during training: `embedding.*.eviction` (time-to-live in steps, a row limit) is applied
every `every_steps` steps by the driver, and checked against a replay of the same batches under the
documented rule (a row whose last update is more than ttl_steps before the eviction's step goes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.data.synth import criteo_schema
from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config


def test_rows_unused_for_ttl_steps_are_evicted_while_training(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    ttl, every, batch, steps = 4, 2, 256, 12
    config = small_run_config(
        synthetic_sources,
        tmp_path,
        **{
            "embedding.default.eviction": {"ttl_steps": ttl, "every_steps": every},
            "training.max_steps": steps,
            "checkpoint.enabled": False,
        },
    )
    runtime = LocalRuntime(config, base_dir=".", data_sources=synthetic_sources)
    try:
        summary = train(config, runtime=runtime)
        ids = runtime.table_rows()["C3"][0]
    finally:
        runtime.shutdown()
    # the oracle: the trainer's batches (the file in order: one trainer, no shuffle), replayed in
    # NumPy; a row lives while its last use is at most `ttl` steps before the last eviction
    columns: list[np.ndarray] = []
    source = DataSource.model_validate(synthetic_sources["train"])
    with open_reader(source, criteo_schema(), batch_size=batch) as reader:
        for batch_rows, _ in zip(reader, range(steps), strict=False):
            sparse = batch_rows.sparse
            index = sparse.keys.index("C3")
            ends = np.cumsum(sparse.lengths)
            begin = ends[index * batch_rows.batch_size - 1] if index else 0
            columns.append(sparse.ids[begin : ends[(index + 1) * batch_rows.batch_size - 1]])
    # step s (0-based) updates its rows at step s; after `done` steps the driver evicts (every
    # `every` steps) the rows whose last update is more than `ttl` steps before `done`
    last_use: dict[int, int] = {}
    evicted = 0
    for step, column in enumerate(columns):
        for value in column.tolist():
            last_use[value] = step
        done = step + 1
        if done % every == 0:
            stale = [value for value, used in last_use.items() if done - used > ttl]
            evicted += len(stale)
            for value in stale:
                del last_use[value]
    alive = set(last_use)
    assert summary["rows_evicted"]["C3"] == evicted > 0
    assert set(ids.tolist()) == alive
