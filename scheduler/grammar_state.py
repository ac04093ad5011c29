"""Structured outputs in the scheduler: the hook points where grammar state meets the batch.

Only the entry rank compiles and holds matchers (the other ranks take its tokens); what every rank
must agree on, it broadcasts: which waiting requests' grammars are ready (or failed), and which
sampled tokens ended their grammar. The hooks, in the order a request meets them:

- `refusal` at arrival: a constraint on a server built without a grammar engine is refused.
- `poll` before admission: a request whose compile is not done stays waiting (the loop never
  blocks on a compile: invariant 18); a compile that fails or outlives the limit fails the
  request (a 400).
- `mask` before sampling: the batch's bitmasks, applied to the logits in one operation (None, at
  no cost, when no request in the batch is constrained).
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

from runtime.distributed import TPGroup
from runtime.grammar import (
    BatchMask,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    ReasoningMatcher,
    fill_batch,
)
from scheduler.req import Req

CompilerFactory = Callable[[], GrammarCompiler]


class GrammarStates:
    """The grammar state of the scheduler's requests, keyed by request identity."""

    def __init__(
        self, tp: TPGroup, make_compiler: CompilerFactory | None, jump_forward: bool = True
    ) -> None:
        self.tp = tp
        self.jump_forward = jump_forward
        self._make = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._futures: dict[int, tuple[Future[object], float]] = {}  # entry rank: compiles
        self.matchers: dict[int, GrammarMatcher] = {}  # entry rank only
        self.ready: set[int] = set()  # every rank: constrained requests that may be admitted

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

    def mask(self, reqs: Sequence[Req], vocab_size: int) -> BatchMask | None:
        """Entry rank: the bitmasks of the batch's constrained rows (None when there is none)."""
        if not self.matchers:
            return None
        return fill_batch([self.matchers.get(id(r)) for r in reqs], vocab_size)

    def advance(
        self, reqs: Sequence[Req], tokens: Sequence[int], errors: dict[int, str]
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
            if not matcher.accept_token(int(token)):
                errors[i] = f"the grammar refused sampled token {int(token)}"
            elif matcher.error():
                errors[i] = f"grammar engine error: {matcher.error()}"
            elif not matcher.is_terminated() and (run := self.forced_run(req, matcher)):
                forced[i] = run
            if i not in errors and matcher.is_terminated():
                ended.add(i)
        return ended, forced

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

    def held(self) -> int:
        """Requests with grammar state (entry rank: matchers or compiles; any rank: ready)."""
        return len(self.ready | self.matchers.keys() | self._futures.keys())

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
