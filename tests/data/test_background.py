"""BackgroundIterator: order, bounded read-ahead, errors re-raised with their type, clean close, gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from psrec.data.background import BackgroundIterator, InputGate, checkpoint, gated
from psrec.data.errors import BadRowError


def _alive(name: str) -> bool:
    return any(thread.name == name for thread in threading.enumerate())


def test_items_arrive_in_order_and_the_source_runs_at_most_depth_ahead() -> None:
    produced: list[int] = []

    def source() -> Iterator[int]:
        for i in range(10):
            produced.append(i)
            yield i

    items = BackgroundIterator(source, depth=2, name="bg-order")
    assert next(items) == 0
    time.sleep(0.2)
    assert len(produced) <= 1 + 2 + 1  # the one consumed, two queued, one waiting to be queued
    assert list(items) == list(range(1, 10))
    items.close()
    assert not _alive("bg-order")


def test_a_source_error_is_raised_in_the_consumer_after_the_items_before_it() -> None:
    def source() -> Iterator[int]:
        yield 1
        raise BadRowError("a.csv", "line 3", "bad")

    items = BackgroundIterator(source, depth=2, name="bg-error")
    assert next(items) == 1
    with pytest.raises(BadRowError, match="a.csv, line 3"):
        next(items)
    assert next(items, None) is None
    items.close()


def test_close_stops_a_producer_blocked_on_a_full_queue_and_wakes_a_waiting_consumer() -> None:
    items = BackgroundIterator(lambda: iter(range(10**9)), depth=1, name="bg-close")
    time.sleep(0.1)
    items.close()
    assert not _alive("bg-close")
    assert next(items, None) is None

    # A consumer waiting on a source that never yields returns once that producer stops.
    release = threading.Event()

    def slow() -> Iterator[int]:
        release.wait()
        return
        yield

    waiting = BackgroundIterator(slow, depth=1, name="bg-slow")
    threading.Timer(0.1, release.set).start()
    assert next(waiting, None) is None
    waiting.close()


def test_a_held_gate_keeps_the_producer_from_starting_items_until_released() -> None:
    gate = InputGate()
    produced: list[int] = []

    def source() -> Iterator[int]:
        for i in range(5):
            produced.append(i)
            yield i

    with gate.held():
        items = BackgroundIterator(source, depth=4, name="bg-gate", gate=gate)
        time.sleep(0.2)
        assert produced == []  # not one item begun while held
        with gate.held():  # nested holds: open only after the outermost ends
            pass
        time.sleep(0.15)
        assert produced == []
    assert list(items) == [0, 1, 2, 3, 4]
    items.close()
    assert not _alive("bg-gate")


def test_close_stops_a_producer_waiting_at_a_held_gate() -> None:
    gate = InputGate()
    with gate.held():
        items = BackgroundIterator(lambda: iter(range(3)), depth=1, name="bg-gate-close", gate=gate)
        time.sleep(0.1)
        items.close()
        assert not _alive("bg-gate-close")
    assert next(items, None) is None


def test_checkpoints_pause_an_item_while_the_gate_is_held_and_released_lets_it_run() -> None:
    gate = InputGate()
    steps: list[str] = []

    started, go = threading.Event(), threading.Event()

    def source() -> Iterator[str]:
        assert gated()
        started.set()
        go.wait()  # the item has begun (the gate was open); the trainer takes its hold now
        steps.append("begun")
        checkpoint()  # inside the item: waits while the gate is held
        steps.append("after checkpoint")
        yield "item"

    items = BackgroundIterator(source, depth=1, name="bg-checkpoint", gate=gate)
    assert started.wait(5)
    with gate.held():
        go.set()
        time.sleep(0.15)
        assert steps == ["begun"]  # paused at the checkpoint
        assert not items.ready()
        with gate.released():  # as the trainer does while it waits for a batch
            assert next(items) == "item"
        assert steps == ["begun", "after checkpoint"]
        with gate.held():  # nesting inside a released block is still a hold
            assert not gate.wait(0)
        assert not gate.wait(0)  # the outer hold is back
    assert gate.wait(0)
    items.close()


def test_close_ends_an_item_paused_at_a_checkpoint_without_an_error() -> None:
    gate = InputGate()
    reached: list[bool] = []

    def source() -> Iterator[int]:
        checkpoint()
        reached.append(True)
        yield 1

    with gate.held():
        items = BackgroundIterator(source, depth=1, name="bg-checkpoint-close", gate=gate)
        time.sleep(0.1)
        items.close()
        assert not _alive("bg-checkpoint-close")
    assert reached == [] and next(items, None) is None


def test_checkpoint_is_a_no_op_outside_gated_producers_and_released_needs_a_hold() -> None:
    checkpoint()
    assert not gated()
    items = BackgroundIterator(lambda: iter([gated()]), depth=1, name="bg-ungated")
    assert list(items) == [False]
    items.close()
    with pytest.raises(RuntimeError, match="needs a hold"), InputGate().released():
        pass
