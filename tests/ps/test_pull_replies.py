"""A training pull sent again is answered with the rows its first copy got, even after an update.

A trainer that dies in step s is replaced and step s runs again (`psrec.elastic.trainer_failover`);
by then a shard may have applied step s (every trainer's push had arrived). The repeated pull must
return what step s read the first time, not the updated rows, and must not count or insert ids again.
The oracle is a plain `ParameterShard` given the same operations once, its pulls recorded as they ran.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from psrec.ps.replay import REPLIES_KEPT, LoggedShard
from tests.ps.test_replay import DIM, Twin, assert_same


def test_a_repeated_pull_gets_its_first_rows_after_the_step_was_applied(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    ids_t, ids_u = np.array([1, 2, 3]), np.array([7, 8, 9])
    requests = {"t": ids_t, "u": ids_u}
    first = {
        name: rows.copy()
        for name, rows in twin.logged.pull(requests, train=True, caller="c", request=1).items()
    }
    twin.oracle.pull(requests)
    twin.push(0, 0, ids_t, ids_u)  # the step's update is applied (one sync trainer)
    assert not np.array_equal(twin.oracle.pull(requests, train=False)["u"], first["u"])
    again = twin.logged.pull(requests, train=True, caller="c", request=1)
    for name in requests:
        np.testing.assert_array_equal(again[name], first[name])
    assert_same(twin.logged.shard, twin.oracle)  # nothing inserted or counted a second time


def test_the_replies_kept_are_rebuilt_by_the_replay(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    requests = {"t": np.array([4, 5]), "u": np.array([11, 12])}
    first = {
        name: rows.copy()
        for name, rows in twin.logged.pull(requests, train=True, caller="c", request=1).items()
    }
    twin.oracle.pull(requests)
    twin.push(0, 0, requests["t"], requests["u"])
    rebuilt = twin.rebuild()
    again = rebuilt.pull(requests, train=True, caller="c", request=1)
    for name in requests:
        np.testing.assert_array_equal(again[name], first[name])
    assert_same(rebuilt.shard, twin.oracle)


def test_only_the_last_pulls_are_kept_and_other_ids_get_the_current_rows(tmp_path: Path) -> None:
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    requests = {"u": np.array([20, 21])}
    for request in range(1, REPLIES_KEPT + 2):
        twin.logged.pull(requests, train=True, caller="c", request=request)
        twin.oracle.pull(requests)
        twin.logged.push(0, request, request, {"u": (requests["u"], np.ones((2, DIM), np.float32))})
        twin.oracle.push(0, request, request, {"u": (requests["u"], np.ones((2, DIM), np.float32))})
    current = twin.oracle.pull(requests, train=False)["u"]
    oldest = twin.logged.pull(requests, train=True, caller="c", request=1)  # no longer kept
    np.testing.assert_array_equal(oldest["u"], current)
    other = {"u": np.array([20])}  # not what pull 3 asked: answered from the current rows
    np.testing.assert_array_equal(
        twin.logged.pull(other, train=True, caller="c", request=3)["u"], current[:1]
    )
    assert_same(twin.logged.shard, twin.oracle)


def test_after_a_restore_the_steps_pulls_are_new_again(tmp_path: Path) -> None:
    """A rollback to step 1 runs step 1 again: its pull (number 2) inserts and counts as new."""
    twin = Twin(tmp_path)
    twin.checkpoint(0, "full")
    twin.step(0)
    twin.checkpoint(1, "full")
    chain = [twin.last]
    twin.step(1)
    twin.step(2)
    logged: LoggedShard = twin.logged
    logged.restore(chain, 1)  # type: ignore[arg-type]
    assert logged.last_pull == {"c": 1}
