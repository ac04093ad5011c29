"""The suite's fault injector, handed to scheduler ranks through the test seam of
scheduler/input_checks.py: with probability `rate` per request and step, the last TP rank's
input check fails.

In-process tests pass a `FaultInjector` to the `Scheduler`; tests and scripts that start ranks
in other processes pass an `InjectorFactory` (picklable: it crosses to each rank) to
`run_scheduler_process` (tests/scheduler_harness.py) or to `launch.main` (tests/fault_server.py,
which scripts/stress.py starts instead of launch.py), and each rank builds its injector with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from scheduler.req import Req


class InjectedFault(RuntimeError):
    """A fault made on purpose by the test's injector."""


@dataclass(frozen=True)
class FaultInjector:
    """The draw is a hash of (seed, rid, tokens so far, KV length), so every rank knows which
    requests are hit (for the counters) while only the last rank raises, and the other ranks
    learn of it through the scheduler's agreement step, as of a real fault."""

    rate: float = 0.0
    seed: int = 0
    raises_here: bool = False

    def hits(self, req: Req) -> bool:
        if self.rate <= 0:
            return False
        key = f"{self.seed}:{req.rid}:{len(req.token_ids)}:{req.kv_len}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64
        return draw < self.rate

    def check(self, req: Req) -> None:
        if self.raises_here and self.hits(req):
            raise InjectedFault(f"injected fault (rate {self.rate})")


@dataclass(frozen=True)
class InjectorFactory:
    """The `FaultsFactory` of scheduler/input_checks.py for `FaultInjector`s: every rank draws
    alike, the last rank raises."""

    rate: float
    seed: int

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError("the fault injection rate must be in [0, 1]")

    def __call__(self, rank: int, tp_size: int) -> FaultInjector:
        return FaultInjector(self.rate, self.seed, raises_here=rank == tp_size - 1)
