"""The restart rule of a replica that died (runtime/replica_health.py): pure, no process."""

from __future__ import annotations

from runtime.replica_health import ReplicaHealth, ReplicaState, RestartPolicy


def test_the_delay_doubles_with_each_death_in_the_window_up_to_its_cap() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=100, base_delay_s=1, max_delay_s=6)
    assert [policy.delay([0.0] * n, 0.0) for n in range(1, 6)] == [1, 2, 4, 6, 6]


def test_restarts_are_bounded_within_the_window_and_counted_again_after_it() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60)
    assert policy.delay([0, 1, 2], 2) is not None
    assert policy.delay([0, 1, 2, 3], 3) is None  # a 4th death in 60 s: it stays down
    assert policy.delay([0, 1, 2, 70], 70) == 1  # the old deaths left the window
    assert RestartPolicy(max_restarts=0).delay([5], 5) is None


def test_a_replica_restarts_then_stays_down_once_its_tries_are_spent() -> None:
    health = ReplicaHealth(RestartPolicy(max_restarts=2, window_s=60, base_delay_s=0.5))
    assert health.info() == {"state": "up", "restarts": 0} and health.alive
    assert health.died(10) == 0.5 and health.state == ReplicaState.RESTARTING and health.alive
    health.restarting()
    health.restarted()
    assert health.info() == {"state": "up", "restarts": 1}
    assert health.died(11) == 1.0  # its second death in the window waits twice as long
    health.restarting()
    assert health.died(12) is None  # the restart failed to start: a third death
    assert health.info() == {"state": "down", "restarts": 2} and not health.alive


def test_deaths_outside_the_window_are_forgotten() -> None:
    health = ReplicaHealth(RestartPolicy(max_restarts=1, window_s=5))
    assert health.died(0) == 1.0
    health.restarted()
    assert health.died(100) == 1.0 and health.deaths == [100]
