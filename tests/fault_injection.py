"""The suite's fault injector, installed into scheduler ranks through the test seam of
scheduler/input_checks.py: with probability `rate` per request and step, the last TP rank's
input check fails.

In-process tests pass a `FaultInjector` to the `Scheduler`; tests and scripts that start ranks
in other processes put `fault_environment(rate, seed)` into their environment (with this folder
on the import path), and each rank builds its injector with `from_environment`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from scheduler.input_checks import TEST_FAULTS_ENV
from scheduler.req import Req

RATE_ENV = "TESSERA_TEST_FAULT_RATE"
SEED_ENV = "TESSERA_TEST_FAULT_SEED"


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


def fault_environment(rate: float, seed: int) -> dict[str, str]:
    """The environment variables that make scheduler ranks started under them inject faults."""
    if not 0 <= rate <= 1:
        raise ValueError("the fault injection rate must be in [0, 1]")
    factory = f"{__name__}:{from_environment.__name__}"
    return {TEST_FAULTS_ENV: factory, RATE_ENV: str(rate), SEED_ENV: str(seed)}


def from_environment(rank: int, tp_size: int) -> FaultInjector:
    """The factory a rank calls (scheduler/input_checks.py): the last rank raises."""
    rate, seed = float(os.environ[RATE_ENV]), int(os.environ[SEED_ENV])
    return FaultInjector(rate, seed, raises_here=rank == tp_size - 1)
