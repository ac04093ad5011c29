"""Whether a data-parallel replica that died is started again, and when (invariant 20).

Pure: no process is touched here. `launch.Supervisor` keeps a `ReplicaHealth` per replica,
tells it each death (`died`) and each finished restart (`restarted`), and reads from it how long
to wait before the next start, or that the replica stays down.

The rule (`RestartPolicy`): a replica is restarted at most `max_restarts` times within any
`window_s` seconds; the n-th death in the window waits `base_delay_s * 2**(n-1)` seconds (at
most `max_delay_s`) before the next start, so a replica that dies at once each time it starts
does not take the CPU from the replicas that serve. The death after the last restart allowed
leaves the replica down for good: the supervisor names it in the log, and stops the server when
no replica is left that serves or restarts.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class ReplicaState(str, enum.Enum):
    UP = "up"  # its ranks reported ready: the dispatcher sends to it
    RESTARTING = "restarting"  # dead, waiting for its next start, or starting
    DOWN = "down"  # dead with its restarts spent: it stays down


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # restarts allowed within any window of window_s seconds
    window_s: float = 600.0
    base_delay_s: float = 1.0  # the wait before the first restart; doubled for each next one
    max_delay_s: float = 30.0

    def delay(self, deaths: Sequence[float], now: float) -> float | None:
        """Seconds to wait before starting again a replica that died at the times `deaths`
        (monotonic seconds, the latest included), or None: its restarts are spent."""
        recent = sum(1 for t in deaths if now - t < self.window_s)
        if recent > self.max_restarts:
            return None
        return min(self.max_delay_s, self.base_delay_s * 2 ** max(0, recent - 1))


@dataclass
class ReplicaHealth:
    """One replica's state, its restarts so far and its recent deaths."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    state: ReplicaState = ReplicaState.UP
    restarts: int = 0  # restarts begun (each counts against the policy, whether it succeeds)
    deaths: list[float] = field(default_factory=list)  # within the policy's window

    def died(self, now: float) -> float | None:
        """The replica died at `now` (a rank exited, or it failed to start): the seconds to wait
        before its next start, or None when it stays down."""
        self.deaths = [t for t in self.deaths if now - t < self.policy.window_s] + [now]
        delay = self.policy.delay(self.deaths, now)
        self.state = ReplicaState.DOWN if delay is None else ReplicaState.RESTARTING
        return delay

    def restarting(self) -> None:
        """A start of its ranks begins."""
        self.restarts += 1

    def restarted(self) -> None:
        """Its ranks reported ready again."""
        self.state = ReplicaState.UP

    @property
    def alive(self) -> bool:
        """It serves, or will once its restart succeeds."""
        return self.state != ReplicaState.DOWN

    def info(self) -> dict[str, object]:
        return {"state": self.state.value, "restarts": self.restarts}
