"""Structured outputs in the scheduler: the hook points where grammar state meets the batch.

Only the entry rank compiles and holds matchers (the other ranks take its tokens); what every rank
must agree on, it broadcasts: which waiting requests' grammars are ready (or failed), and which
sampled tokens ended their grammar. The hooks, in the order a request meets them:

- `refusal` at arrival: a constraint on a server built without a grammar engine is refused.
- `poll` before admission: a request whose compile is not done stays waiting (the loop never
  blocks on a compile: invariant 18); a compile that fails or outlives the limit fails the
  request (a 400).
- `mask` before sampling: the batch's bitmasks, applied to the logits in one operation (None, at
  no cost, when no request in the batch is constrained). A grammar that fails at its fill (the
  engine gave up at a per-step limit, no token satisfies it, or its request's grammar work is
  over its time budget) ends its request at that step with a `GrammarFault`: a 400 naming the
  constraint's field, never a slow decode to max_tokens and a 500.
- `advance` after sampling: each kept token moves its matcher (invariant 17); a grammar that
  can only end stops its request with "stop". Jump-forward: the tokens the grammar then forces
  are accepted too and appended after the sampled one; the scheduler computes them (and the
  sampled token) as one extend in the next step (`Scheduler.forward_decode`).
- `drop` when a request ends for any reason. Retraction keeps a request's tokens (only their KV
  is recomputed), so its matcher stays exactly where it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from runtime.distributed import TPGroup
from runtime.grammar import (
    BatchMask,
    GrammarCompiler,
    GrammarError,
    GrammarFault,
    GrammarMatcher,
    GrammarSpec,
    ReasoningMatcher,
    fill_batch,
)
from scheduler.req import Req

CompilerFactory = Callable[[], GrammarCompiler]
StepErrors = dict[int, "str | GrammarFault"]  # batch row -> why its request fails this step


@dataclass(frozen=True)
class GrammarBudget:
    """The entry rank's CPU time one request's grammar may take (mask fills, token accepts,
    forced runs): `ms_per_token` on average over the tokens it produced, counted over at least
    `grace_tokens` (a slow first mask is no fault). 0: no budget. The engine's per-step limits
    bound one fill; this bounds how long a costly grammar may keep slowing everyone's steps."""

    ms_per_token: float = 10.0
    grace_tokens: int = 100

    def allows(self, spent_s: float, tokens: int) -> bool:
        limit_s = self.ms_per_token / 1000 * max(tokens, self.grace_tokens)
        return self.ms_per_token <= 0 or spent_s <= limit_s


class GrammarStates:
    """The grammar state of the scheduler's requests, keyed by request identity."""

    def __init__(
        self,
        tp: TPGroup,
        make_compiler: CompilerFactory | None,
        jump_forward: bool = True,
        budget: GrammarBudget = GrammarBudget(),
    ) -> None:
        self.tp = tp
        self.jump_forward = jump_forward
        self.budget = budget
        self._make = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._futures: dict[int, tuple[Future[object], float]] = {}  # entry rank: compiles
        self.matchers: dict[int, GrammarMatcher] = {}  # entry rank only
        self.ready: set[int] = set()  # every rank: constrained requests that may be admitted
        self.spent: dict[int, float] = {}  # entry rank: CPU seconds each request's grammar took

    def refusal(self, req: Req) -> str:
        if req.params.grammar is None or self._make is not None:
            return ""
        return "structured outputs are not available: this server has no grammar engine"

    def is_ready(self, req: Req) -> bool:
        return req.params.grammar is None or id(req) in self.ready

    def poll(self, waiting: Sequence[Req]) -> list[tuple[Req, str]]:
        """Mark the waiting requests whose grammar compiled as ready (every rank alike); returns
        those whose compile failed, with why."""
        pending = [r for r in waiting if not self.is_ready(r)]
        if not pending:
            return []
        resolved = self._resolve(pending) if self.tp.is_first else None
        resolved = self.tp.broadcast_pyobj(resolved)
        failed = []
        for i, problem in resolved.items():
            if problem:
                failed.append((pending[i], problem))
            else:
                self.ready.add(id(pending[i]))
        return failed

    def _resolve(self, pending: list[Req]) -> dict[int, str]:
        """Entry rank: index -> "" (ready, its matcher made) or the error, for each request
        whose compile is over; the others are left pending."""
        resolved = {}
        for i, req in enumerate(pending):
            spec = req.params.grammar
            assert spec is not None
            try:
                matcher = self._matcher_if_done(req, spec)
            except GrammarError as exc:
                self._futures.pop(id(req), None)
                resolved[i] = f"{exc.param or spec.kind}: {exc}"
                continue
            if matcher is not None:
                self.matchers[id(req)] = matcher
                resolved[i] = ""
        return resolved

    def _matcher_if_done(self, req: Req, spec: GrammarSpec) -> GrammarMatcher | None:
        compiler = self.compiler()
        if id(req) not in self._futures:
            self._futures[id(req)] = (compiler.submit(spec), time.monotonic())
        future, since = self._futures[id(req)]
        if not future.done():
            if time.monotonic() - since > compiler.limits.timeout_s:
                limit = compiler.limits.timeout_s
                raise GrammarError(f"{spec.kind} did not compile within {limit:g} s", spec.param)
            return None
        del self._futures[id(req)]
        try:
            compiled = future.result()
        except GrammarError as exc:
            raise GrammarError(str(exc), spec.param) from None
        matcher = compiler.backend.new_matcher(compiled)
        return ReasoningMatcher.around(matcher, spec.think) if spec.think else matcher

    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            assert self._make is not None
            try:
                self._compiler = self._make()
            except OSError as exc:  # no tokenizer.json: constraints cannot be compiled here
                raise GrammarError(f"no grammar engine for this checkpoint: {exc}") from None
        return self._compiler

    def mask(
        self, reqs: Sequence[Req], vocab_size: int
    ) -> tuple[BatchMask | None, dict[int, GrammarFault]]:
        """Entry rank: the bitmasks of the batch's constrained rows (None when there is none),
        and the rows whose grammar failed at this fill (their rows allow every token: the
        token sampled there is thrown away with its request)."""
        if not self.matchers:
            return None, {}
        mask = fill_batch([self.matchers.get(id(r)) for r in reqs], vocab_size)
        if mask is None:
            return None, {}
        faults = {}
        for slot, row in enumerate(mask.rows.tolist()):
            self.charge(reqs[row], mask.fill_s[slot])
            if (fault := self.fill_fault(reqs[row], mask, slot)) is not None:
                faults[row] = fault
                mask.allow_all(slot)
        return mask, faults

    def fill_fault(self, req: Req, mask: BatchMask, slot: int) -> GrammarFault | None:
        """Why this request's grammar cannot give its next token (None when it can)."""
        matcher, produced = self.matchers[id(req)], len(req.output_ids)
        if problem := matcher.error():
            return self.limit_fault(req, problem)
        if not mask.allows_any(slot):
            return self.fault(req, f"has no token that satisfies it after {produced} tokens")
        if not self.budget.allows(self.spent[id(req)], produced):
            spent_ms = self.spent[id(req)] * 1000
            return self.fault(
                req,
                f"took {spent_ms:.0f} ms of engine time over {produced} tokens, more than its "
                f"budget of {self.budget.ms_per_token:g} ms a token",
            )
        return None

    @staticmethod
    def fault(req: Req, what: str, engine: str = "") -> GrammarFault:
        spec = req.params.grammar
        assert spec is not None
        detail = f"{spec.param or spec.kind}: the grammar {what}"
        return GrammarFault(f"{detail} ({engine})" if engine else detail, spec.param)

    def limit_fault(self, req: Req, engine: str) -> GrammarFault:
        what = f"exceeded its per-step limit after {len(req.output_ids)} tokens"
        return self.fault(req, what, engine)

    def charge(self, req: Req, seconds: float) -> None:
        self.spent[id(req)] = self.spent.get(id(req), 0.0) + seconds

    def advance(
        self, reqs: Sequence[Req], tokens: Sequence[int], errors: StepErrors
    ) -> tuple[set[int], dict[int, list[int]]]:
        """Entry rank, after sampling: move each constrained request's matcher by its token,
        then by the tokens its grammar forces next (jump-forward: row -> those tokens, which
        the request appends after its token and computes in one extend). Returns the rows whose
        grammar has ended and the forced runs; a token the grammar refuses (or an engine error)
        goes into `errors`, failing its request."""
        ended, forced = set(), {}
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            matcher = self.matchers.get(id(req))
            if matcher is None or i in errors:
                continue
            start = time.thread_time()
            if problem := self.accept(req, matcher, int(token)):
                errors[i] = problem
            elif not matcher.is_terminated() and (run := self.forced_run(req, matcher)):
                forced[i] = run
            self.charge(req, time.thread_time() - start)
            if i not in errors and matcher.is_terminated():
                ended.add(i)
        return ended, forced

    def accept(self, req: Req, matcher: GrammarMatcher, token: int) -> str | GrammarFault:
        """Move the matcher by a sampled token: "" when it took it, else why its request fails
        (an engine limit hit while taking it is the grammar's fault; a refused token, ours)."""
        accepted = matcher.accept_token(token)
        if problem := matcher.error():
            return self.limit_fault(req, problem)
        return "" if accepted else f"the grammar refused sampled token {token}"

    def forced_run(self, req: Req, matcher: GrammarMatcher) -> list[int]:
        """The tokens the grammar forces after the one just accepted (llguidance's forced
        tokens: their tokenization is settled), accepted now; none for a request that asked for
        logprobs (each token keeps its own forward and its real logprob); cut to what
        max_tokens leaves, and short of min_tokens while the request is under it (the
        detokenizer arms stop strings per delivered run)."""
        if not self.jump_forward or req.params.logprobs is not None:
            return []
        produced = len(req.output_ids) + 1  # its sampled token is not appended yet
        room = req.params.max_new_tokens - produced
        if produced < req.params.min_tokens:
            room = min(room, req.params.min_tokens - produced - 1)
        run = []
        for token in matcher.jump_forward().tokens[: max(room, 0)]:
            if not matcher.accept_token(token):
                break
            run.append(token)
        return run

    def drop(self, req: Req) -> None:
        """The request ended (finish, abort, failure): its state goes."""
        self.matchers.pop(id(req), None)
        self._futures.pop(id(req), None)
        self.ready.discard(id(req))
        self.spent.pop(id(req), None)

    def held(self) -> int:
        """Requests with grammar state (entry rank: matchers or compiles; any rank: ready)."""
        return len(self.ready | self.matchers.keys() | self._futures.keys() | self.spent.keys())

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
