"""`choose_restart` counts shard failovers against the same `max_restarts` budget as rollbacks."""

from psrec.checkpoint.policy import choose_restart


def test_shard_failovers_spend_the_restart_budget() -> None:
    fresh = choose_restart(
        actor_failure=True, dead_actors=["shard 1"], restarts=0, max_restarts=3, failovers=2
    )
    assert fresh.recover and "restart 3 of at most 3" in fresh.detail and "2 shard failovers" in fresh.detail
    spent = choose_restart(
        actor_failure=True, dead_actors=["shard 1"], restarts=1, max_restarts=3, failovers=2
    )
    assert not spent.recover and spent.reason == "max restarts reached"
    assert "1 restarts and 2 shard failovers" in spent.detail


def test_without_failovers_the_budget_is_the_rollbacks_alone() -> None:
    decision = choose_restart(actor_failure=True, dead_actors=["trainer 0"], restarts=2, max_restarts=3)
    assert decision.recover and decision.detail.endswith("restart 3 of at most 3")
