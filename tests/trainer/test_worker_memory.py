"""A trainer gives its freed memory back before each evaluation (`psrec.allocator.release_free_memory`):
evaluation batches are larger than training's, so the blocks training freed do not serve them; and
malloc's free memory after each evaluation batch, before the next one's.

Run: ``python -m pytest tests/trainer/test_worker_memory.py -q``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from psrec.train.loop import train
from psrec.train.runtime import LocalRuntime
from psrec.trainer import readers as readers_module
from psrec.trainer import worker as worker_module
from tests.conftest import small_run_config


def test_memory_is_released_before_every_evaluation(
    synthetic_sources: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    release, open_reader = worker_module.release_free_memory, worker_module.open_reader

    def recorded_release(*, pools: bool = True) -> bool:
        events.append("release" if pools else "release malloc")
        return release(pools=pools)

    def recorded_open(*args: Any, **kwargs: Any) -> Any:
        events.append(f"open {kwargs['batch_size']}")
        return open_reader(*args, **kwargs)

    monkeypatch.setattr(worker_module, "release_free_memory", recorded_release)  # before evaluating
    monkeypatch.setattr(readers_module, "release_free_memory", recorded_release)  # after each batch
    monkeypatch.setattr(worker_module, "open_reader", recorded_open)
    config = small_run_config(
        synthetic_sources, tmp_path / "run", **{"training.eval_every_steps": 40, "training.max_steps": 80}
    )
    runtime = LocalRuntime(config, base_dir=".", data_sources=synthetic_sources)
    try:
        summary = train(config, runtime=runtime)
    finally:
        runtime.shutdown()
    evaluation = f"open {config.training.eval_batch_size}"
    opened = [index for index, event in enumerate(events) if event == evaluation]
    assert len(opened) == len(summary["history"]) >= 2  # every evaluation: at 40 steps, at 80
    assert all(events[index - 1] == "release" for index in opened), events
    assert events.count("release") == len(opened)  # and never in training
    # after each evaluation batch (6,000 validation rows: one batch), malloc's free memory alone
    batches = -(-6_000 // config.training.eval_batch_size)
    assert events.count("release malloc") == batches * len(opened)
    for index in opened:
        assert events[index + 1 : index + 1 + batches] == ["release malloc"] * batches, events
