"""The front end's check of a request's constraint before it reaches the scheduler.

Every untried constraint (schemas, json_object, regex, choice, GBNF or Lark grammars, structural
tags, tool-call grammars: every `GrammarSpec`) is compiled in a grammar worker process
(`grammar_worker`: `cpu_pool.WorkerPool` jobs under a CPU-time and an address-space limit), never
in this process and never first by a scheduler rank, which compiles only what passed here. A
compile that crashes the engine (SIGSEGV), exhausts its memory or runs past its deadline ends
only its worker, which is replaced; the constraint is a 400 naming its field. Verdicts (compiles,
or why not) are cached by the constraint's text, failures too, so a hostile constraint sent again
is refused without another compile. Size and shape limits (`runtime.grammar.check_limits`) are
checked first, here, before any worker.

Two lanes, so slow compiles cannot delay small ones: a constraint of up to `fast_lane_bytes` goes
to the fast lane's own worker under a short deadline; one that overruns it is killed there and
tried again in the slow lane (its own workers, the full deadline), where large constraints go
directly. Each wait holds a deadline (invariant 14) and nothing runs on the event loop but
bookkeeping (invariant 18).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from runtime.grammar import (
    CheckpointGrammar,
    CompileLimits,
    GrammarError,
    GrammarSpec,
    check_limits,
)
from runtime.logging_utils import get_logger
from tokenizer_manager.cpu_pool import JobTimeout, WorkerDied, WorkerPool
from tokenizer_manager.grammar_worker import check_compiles, init_grammar_worker
from tokenizer_manager.protocol import APIError

logger = get_logger(__name__)

NOUNS = {"json_schema": "schema", "json_object": "schema", "ebnf": "grammar"}


@dataclass(frozen=True)
class Verdict:
    """A constraint's answer: `reason` why it does not compile (as the client reads it), or
    None when it compiles, with the engine's `prepared` form of it when it has one."""

    reason: str | None = None
    prepared: str | None = None


@dataclass(frozen=True)
class CheckLimits:
    compile: CompileLimits = field(default_factory=CompileLimits)  # sizes, shapes, deadline
    fast_lane_bytes: int = 8 << 10  # constraints up to this size try the fast lane first
    fast_timeout_s: float = 2.0  # the fast lane's deadline (CPU and wall time)
    slow_workers: int = 2
    memory_bytes: int = 1 << 30  # address space a compile may add to its worker
    wait_s: float = 60.0  # the longest a request waits for a verdict (queue and compiles)


class GrammarCheck:
    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        limits: CheckLimits = CheckLimits(),
    ) -> None:
        self.source = CheckpointGrammar(model_path, vocab_size, tuple(stop_token_ids))
        self.limits = limits
        self._fast: WorkerPool | None = None  # both started by the first constraint
        self._slow: WorkerPool | None = None
        self._verdicts: OrderedDict[tuple[str, str], asyncio.Future[Verdict]] = OrderedDict()

    async def check(self, spec: GrammarSpec) -> GrammarSpec:
        """`spec` as the scheduler compiles it (its prepared form, when it has one); a 400
        naming `spec.param` when the constraint does not compile within the limits."""
        try:
            check_limits(spec, self.limits.compile)
        except GrammarError as exc:
            raise refusal(spec, str(exc)) from None
        verdict = self._verdict(spec)
        try:
            answer = await asyncio.wait_for(asyncio.shield(verdict), self.limits.wait_s)
        except TimeoutError:  # still queued: the verdict, once in, is kept for the next request
            message = "constraint compiles are backed up; try again"
            raise APIError(message, 503, spec.param, "grammar_busy", retry_after=5) from None
        if answer.reason is not None:
            raise refusal(spec, answer.reason)
        return dataclasses.replace(spec, prepared=answer.prepared) if answer.prepared else spec

    def _verdict(self, spec: GrammarSpec) -> asyncio.Future[Verdict]:
        """The cached verdict for `spec`, or one now on its way (LRU of `cache_size`)."""
        verdict = self._verdicts.get(spec.key)
        if verdict is not None:
            self._verdicts.move_to_end(spec.key)
            return verdict
        verdict = asyncio.ensure_future(self._compile(spec))
        verdict.add_done_callback(partial(self._forget_if_broken, spec.key))
        self._verdicts[spec.key] = verdict
        while len(self._verdicts) > self.limits.compile.cache_size:
            self._verdicts.popitem(last=False)
        return verdict

    def _forget_if_broken(self, key: tuple[str, str], verdict: asyncio.Future[Verdict]) -> None:
        """A compile that did not reach a verdict (the pool closed) is not cached."""
        if (verdict.cancelled() or verdict.exception()) and self._verdicts.get(key) is verdict:
            del self._verdicts[key]

    async def _compile(self, spec: GrammarSpec) -> Verdict:
        if len(spec.text.encode("utf-8")) <= self.limits.fast_lane_bytes:
            try:
                return await self._try(self._lanes()[0], spec)
            except JobTimeout:
                logger.info("a %s overran the fast lane; trying the slow lane", spec.kind)
        try:
            return await self._try(self._lanes()[1], spec)
        except JobTimeout as exc:
            logger.warning("a %s compile was stopped: %s", spec.kind, exc)
            return Verdict(f"the {noun(spec)} is too complex to compile ({exc})")

    async def _try(self, lane: WorkerPool, spec: GrammarSpec) -> Verdict:
        """The verdict on `spec` from one of `lane`'s workers; JobTimeout when
        it ran past the lane's deadline (its worker is killed and replaced)."""
        try:
            prepared = await asyncio.wrap_future(
                lane.submit(check_compiles, spec, self.source, self.limits.compile)
            )
        except GrammarError as exc:
            return Verdict(str(exc))
        except (WorkerDied, MemoryError) as exc:
            logger.warning("a %s compile ended its worker: %s", spec.kind, exc)
            return Verdict(f"the {noun(spec)} is too complex to compile")
        return Verdict(prepared=prepared)

    def _lanes(self) -> tuple[WorkerPool, WorkerPool]:
        if self._fast is None or self._slow is None:
            self._fast = self._pool(1, self.limits.fast_timeout_s)
            self._slow = self._pool(self.limits.slow_workers, self.limits.compile.timeout_s)
        return self._fast, self._slow

    def _pool(self, size: int, seconds: float) -> WorkerPool:
        return WorkerPool(
            size,
            job_timeout=seconds,
            cpu_seconds=seconds,
            initializer=init_grammar_worker,
            initargs=(self.source, self.limits.compile),
            name="grammar",
            memory_bytes=self.limits.memory_bytes,
        )

    def info(self) -> dict[str, int]:
        """/server_info's grammar: verdicts cached, and compiles not yet judged."""
        pending = sum(not v.done() for v in self._verdicts.values())
        return {"verdicts": len(self._verdicts) - pending, "compiling": pending}

    def lane_pids(self) -> dict[str, list[int]]:
        """Each lane's worker process ids (none before the first constraint)."""
        lanes = {"fast": self._fast, "slow": self._slow}
        return {name: pool.pids() if pool else [] for name, pool in lanes.items()}

    async def close(self) -> None:
        for pool in (self._fast, self._slow):
            if pool is not None:
                await asyncio.to_thread(pool.shutdown)


def noun(spec: GrammarSpec) -> str:
    return NOUNS.get(spec.kind, spec.kind.replace("_", " "))


def refusal(spec: GrammarSpec, reason: str) -> APIError:
    """The 400 for a constraint that does not compile, naming its field."""
    message = f"{spec.param}: {reason}" if spec.param else reason
    return APIError(message, param=spec.param)
