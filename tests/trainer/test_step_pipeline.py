"""The step's task parallelism (planner thread, early next pull) changes no result and reads no extra batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from psrec.data.background import InputGate
from psrec.data.batch import Batch
from psrec.data.errors import BadRowError
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource
from psrec.ps.client import LocalConnection
from psrec.ps.shard import ParameterShard
from psrec.trainer import builders
from psrec.trainer.lookup import batch_lookup
from psrec.trainer.step import OVERLAPPED, StepRunner
from tests.conftest import small_run_config


def _setup(
    config: Any, gate: InputGate | None = None, connection: type[LocalConnection] = LocalConnection
) -> tuple[StepRunner, list[ParameterShard]]:
    torch.manual_seed(config.training.seed)
    shards = [ParameterShard(i, builders.build_tables(config)) for i in range(2)]
    model = builders.build_model_for(config)
    client = batch_lookup(
        [connection(shard) for shard in shards],
        builders.bucket_map(config),
        table_dims={n: s.dim for n, s in builders.table_specs(config).items()},
        feature_tables=builders.feature_tables(config),
    )
    runner = StepRunner(model, builders.build_dense_optimizer(config, model), client, input_gate=gate)
    return runner, shards


def _batches(config: Any, sources: dict[str, Any], count: int) -> list[Batch]:
    reader = open_reader(
        DataSource.model_validate(sources["train"]),
        config.feature_schema(),
        batch_size=config.training.batch_size,
        seed=0,
    )
    batches = [batch for _, batch in zip(range(count), reader, strict=False)]
    reader.close()
    return batches


class _Counting:
    def __init__(self, batches: list[Batch], fail_at: int | None = None) -> None:
        self.batches = iter(batches)
        self.taken = 0
        self.fail_at = fail_at

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.taken == self.fail_at:
            raise BadRowError("train.csv", "line 7", "bad row", "1\tx")
        batch = next(self.batches)
        self.taken += 1
        return batch


def test_pipelined_steps_equal_plain_sequential_steps(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    config = small_run_config(synthetic_sources, tmp_path)
    batches = _batches(config, synthetic_sources, 8)
    runner, shards = _setup(config)
    losses = [result.loss for result in runner.run(iter(batches), first_step=0, max_steps=8)]

    # The oracle: pull, forward/backward, push and dense step one batch after the other, no overlap.
    oracle, oracle_shards = _setup(config)
    oracle_losses = []
    for step, batch in enumerate(batches):
        plan = oracle.client.plan(batch)
        pulled = oracle.client.pull(plan, train=True)
        inp, weights = oracle.client.embed(plan, pulled, batch.dense)
        loss, _ = oracle.model.loss(inp, torch.from_numpy(batch.labels.copy()))  # type: ignore[operator]
        oracle.optimizer.zero_grad()
        loss.backward()
        for handle in oracle.client.submit_push(plan, weights, step=step):
            handle.result()
        oracle.optimizer.step()
        oracle_losses.append(float(loss.detach()))
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-6)
    for shard, oracle_shard in zip(shards, oracle_shards, strict=True):
        for table, (ids, rows) in oracle_shard.table_rows().items():
            np.testing.assert_array_equal(shard.table_rows()[table][0], ids)
            np.testing.assert_array_equal(shard.table_rows()[table][1], rows)
    assert runner.timer.seconds["plan" + OVERLAPPED] > 0


def test_in_process_steps_hold_the_input_gate_throughout_and_change_no_result(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    gate = InputGate()
    held_during: list[tuple[str, bool]] = []

    class Spying(LocalConnection):
        def pull(self, requests: dict[str, np.ndarray], *, train: bool, out: Any = None) -> Any:
            held_during.append(("pull", not gate.wait(0)))
            return super().pull(requests, train=train, out=out)

        def push(self, trainer: int, request_id: int, step: int, gradients: Any) -> Any:
            held_during.append(("push", not gate.wait(0)))
            return super().push(trainer, request_id, step, gradients)

    config = small_run_config(synthetic_sources, tmp_path)
    batches = _batches(config, synthetic_sources, 6)
    gated, gated_shards = _setup(config, gate, Spying)
    dense_step = gated.optimizer.step

    def spying_step() -> Any:
        held_during.append(("optimizer", not gate.wait(0)))
        return dense_step()

    gated.optimizer.step = spying_step  # type: ignore[method-assign]
    model_loss = gated.model.loss

    def spying_loss(*args: Any) -> Any:
        held_during.append(("forward", not gate.wait(0)))
        return model_loss(*args)

    gated.model.loss = spying_loss  # type: ignore[method-assign]
    losses = [r.loss for r in gated.run(iter(batches), first_step=0, max_steps=6)]
    assert {call for call, _ in held_during} == {"pull", "forward", "push", "optimizer"}
    assert all(held for _, held in held_during)  # the whole step runs with the input threads held
    assert gate.wait(0)  # open again between runs: the input threads may read ahead

    plain, plain_shards = _setup(config)
    assert losses == [r.loss for r in plain.run(iter(batches), first_step=0, max_steps=6)]
    for shard, other in zip(gated_shards, plain_shards, strict=True):
        for table, (_ids, rows) in other.table_rows().items():
            np.testing.assert_array_equal(shard.table_rows()[table][1], rows)


def test_planner_reads_ahead_across_runs_and_records_the_trained_position(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    """Chunks of one reader train on the same batches as one run; the position is that of the last
    batch trained, however far the planner read ahead; a new reader starts a new planner."""
    config = small_run_config(synthetic_sources, tmp_path)
    batches = _batches(config, synthetic_sources, 10)
    source = _Counting(iter(batches))
    runner, shards = _setup(config)
    first = [r.loss for r in runner.run(source, first_step=0, max_steps=3, position=lambda: source.taken)]
    assert len(first) == 3 and runner.trained_position == 3  # source.taken may be ahead of it
    rest = [r.loss for r in runner.run(source, first_step=3, max_steps=100, position=lambda: source.taken)]
    assert len(rest) == 7 and runner.trained_position == 10 and source.taken == 10

    whole, whole_shards = _setup(config)
    losses = [r.loss for r in whole.run(iter(batches), first_step=0, max_steps=10)]
    assert first + rest == losses
    for shard, other in zip(shards, whole_shards, strict=True):
        for table, (_ids, rows) in other.table_rows().items():
            np.testing.assert_array_equal(shard.table_rows()[table][1], rows)

    runner.close()
    assert runner.trained_position is None
    again = _Counting(iter(batches[:2]))
    assert len(list(runner.run(again, first_step=10, max_steps=5, position=lambda: again.taken))) == 2
    assert runner.trained_position == 2


def test_reader_errors_reach_the_caller_with_their_type(
    synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    config = small_run_config(synthetic_sources, tmp_path)
    source = _Counting(_batches(config, synthetic_sources, 10), fail_at=2)
    runner, _ = _setup(config)
    steps = []
    with pytest.raises(BadRowError, match="train.csv"):
        for result in runner.run(source, first_step=0, max_steps=10):
            steps.append(result.step)
    assert steps == [0, 1]


def test_planner_peek_shows_the_next_item_without_taking_it() -> None:
    """`peek` returns the item `next` returns next (once it is ready), never skips or repeats one,
    and keeps a reader error for `next` to raise when its batch is due."""
    import time

    from psrec.trainer.step import PhaseTimer, _Planner

    class Plans:
        def plan(self, batch: Any) -> Any:
            return ("plan", batch)

    source = _Counting(cast(list[Batch], ["a", "b"]), fail_at=2)
    planner = _Planner(source, cast(Any, Plans()), PhaseTimer(), position=lambda: source.taken)
    deadline = time.monotonic() + 10
    while planner.peek() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert planner.peek() == ("a", ("plan", "a"), 1)
    assert planner.next() == ("a", ("plan", "a"), 1)
    assert planner.next() == ("b", ("plan", "b"), 2)
    deadline = time.monotonic() + 10
    while not planner._plans.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert planner.peek() is None  # the reader failed: nothing to show, the error kept
    with pytest.raises(BadRowError, match="train.csv"):
        planner.next()
    planner.close()
