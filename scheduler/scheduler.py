"""The scheduler: continuous batching over a radix prefix cache, identical on every TP rank.

Each step: take the messages rank 0 received (broadcast to all ranks), admit what fits into a
prefill batch (or else decode the running batch), run the model, and append one token per
finished-prefill or decoding request. With mixed steps (`enable_mixed_chunk`) the running
requests decode inside the prefill's forward, as one-token extends, whenever their KV fits.
Rank 0 samples; the tokens are broadcast, so every rank keeps the same state and joins the same
collectives. A prefill step is one `PrefillBatch` (scheduler/batch.py); every KV slot, radix
lock and encoder pin is taken and given back through the `CacheManager` (scheduler/cache.py).

Fault isolation: a fault that belongs to one request (its inputs before a forward, its sampling)
fails that request alone with an error finish; `isolate` makes every rank agree on which requests
failed (one flag per request, max-reduced over the CPU group) before any of them is freed, and
`fail` frees everything the request held without caching its KV. Anything else raised by a step
cannot be pinned on a request and ends the server (see scheduler/process.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.allocator import frozen_startup_objects
from runtime.distributed import TPGroup
from runtime.grammar import GrammarFault, apply_bitmask
from runtime.io_struct import (
    AbortReq,
    FinishKind,
    FlushCacheOut,
    FlushCacheReq,
    GetServerInfoReq,
    ItemEmbeddings,
    ItemPixels,
    PixelsWanted,
    PrefixCut,
    ReqOutput,
    ReqStart,
    SchedulerCounters,
    SchedulerRequest,
    ServerInfo,
    TokenizedGenerateReq,
    UnknownMessage,
)
from runtime.logging_utils import get_logger
from runtime.sampler import NON_FINITE, RowControls, Sampler, token_logprobs
from runtime.sampling_params import SamplingParams
from runtime.token_budget import TokenBudget
from scheduler.batch import PrefillBatch
from scheduler.cache import CacheManager
from scheduler.encoder_cache import EncoderCache
from scheduler.grammar_state import CompilerFactory, GrammarBudget, GrammarStates, StepErrors
from scheduler.input_checks import RequestFaults, check_inputs, check_item
from scheduler.model_runner import ModelRunner
from scheduler.overlap import InFlight, OverlapDecoder, continues
from scheduler.radix_cache import RadixCache
from scheduler.req import Req
from scheduler.schedule_policy import (
    PREEMPT_AFTER_STEPS,
    TRIES_BEHIND_A_WAIT,
    Holder,
    PrefillAdder,
    admission_victim,
    batch_sharer,
    decode_reserve,
    may_share,
    retraction_victim,
)
from vision.fusion import overlaps

logger = get_logger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    context_length: int
    # running decodes ride along each prefill step; no default here: ServerArgs holds it, and
    # build_scheduler passes the flag
    enable_mixed_chunk: bool
    schedule_policy: str = "fcfs"
    eos_token_ids: tuple[int, ...] = ()
    check_integrity_when_idle: bool = True
    # vision patches one prefill step may encode past its first media request; 0: no bound
    max_encoder_patches_per_step: int = 0
    enable_jump_forward: bool = True  # tokens a grammar forces are computed as one extend
    grammar_budget: GrammarBudget = GrammarBudget()  # what one request's grammar may cost
    vocab_size: int = 2**31  # token ids a request may name (logit_bias, allowed_token_ids)
    media_token_ids: dict[str, int] = field(default_factory=dict)  # modality -> placeholder id
    enable_overlap: bool = False  # launch a decode step before reading the last one's tokens


@dataclass
class StepResult:
    outputs: list[ReqOutput] = field(default_factory=list)
    started: list[ReqStart] = field(default_factory=list)  # admitted this step
    replies: list[object] = field(default_factory=list)  # control answers for rank 0 to send
    evicted: list[PrefixCut] = field(default_factory=list)  # radix leaves evicted this step


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        tp: TPGroup,
        runner: ModelRunner,
        radix: RadixCache,
        encoder_cache: EncoderCache,
        sampler: Sampler,
        grammar_compiler: CompilerFactory | None = None,
        faults: RequestFaults | None = None,  # testing only: see scheduler/input_checks.py
    ):
        self.cfg, self.tp, self.runner, self.sampler = cfg, tp, runner, sampler
        self.cache = CacheManager(runner, radix, encoder_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        # cut before an item whose embedding has not arrived: each keeps its slot, KV and lock
        self.parked: list[Req] = []
        self.counters = SchedulerCounters()
        self._arrivals = 0
        self._started: list[ReqStart] = []
        self._asks: list[PixelsWanted] = []  # this step's questions to the front end
        # an ordered set by identity (invariant 12): a reused rid never hides another's output
        self._touched: dict[Req, None] = {}
        self._was_idle = True
        self.grammar = GrammarStates(
            tp, grammar_compiler, cfg.enable_jump_forward, cfg.grammar_budget
        )
        self.faults = faults
        self.overlap = OverlapDecoder(runner, sampler) if cfg.enable_overlap else None
        self.in_flight: InFlight | None = None  # a decode step launched, its tokens not read

    # ------------------------------------------------------------------ the loop body
    def step(self, messages: list[SchedulerRequest]) -> StepResult:
        result = StepResult()
        if messages or self.waiting or self.chunked:
            self.resolve_in_flight()  # only a stream of plain decode steps overlaps
        for msg in messages:
            self.handle(msg, result)
        batch = self.schedule_prefill()
        if batch:
            batch.decodes = self.riding_decodes(batch)
            self.run_prefill(batch)
        elif self.running:
            self.run_decode()
        result.outputs = self.collect_outputs()
        result.started, self._started = self._started, []
        result.replies.extend(self._asks)
        self._asks = []
        result.evicted = self.radix.take_evicted()
        if self.idle and not self._was_idle and self.cfg.check_integrity_when_idle:
            self.check_idle_accounting()  # once per transition to idle, not on every poll
        self._was_idle = self.idle
        return result

    @property
    def idle(self) -> bool:
        return (
            not self.waiting
            and not self.running
            and self.chunked is None
            and self.in_flight is None
            and not self.parked
        )

    @property
    def blocked(self) -> bool:
        """Nothing can run until a message comes: idle, or every request waits for pixels or
        for an item's embedding."""
        return (
            not self.running
            and self.chunked is None
            and self.in_flight is None
            and all(r.wants_pixels or r.waits_for_items for r in self.waiting)
            and all(r.ready_len <= 0 for r in self.parked)
        )

    @property
    def radix(self) -> RadixCache:
        return self.cache.radix

    @property
    def encoder_cache(self) -> EncoderCache:
        return self.cache.encoder_cache

    # ------------------------------------------------------------------ messages
    def handle(self, msg: SchedulerRequest, result: StepResult) -> None:
        match msg:
            case TokenizedGenerateReq():
                self.add_request(msg)
            case AbortReq(rid=rid, index=index):
                self.abort(rid, index)
            case FlushCacheReq():
                result.replies.append(self.flush_cache())
            case GetServerInfoReq():
                result.replies.append(self.server_info())
            case ItemPixels():
                self.take_pixels(msg)
            case ItemEmbeddings():
                self.take_embeddings(msg)
            case _:
                raise UnknownMessage(msg, "tokenizer -> scheduler")

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Admit a request: with n > 1, its n choices, the first of which prefills the prompt
        while the others wait and then fork from its cached prefix (see `ready`). Choices that
        can never fit the KV pool together are all refused."""
        p = msg.sampling_params
        problem = self.budget.choices_problem(len(msg.input_ids), p.max_new_tokens, p.n)
        first = None
        for index, params in enumerate(choice_params(msg.sampling_params)):
            self._arrivals += 1
            choice = dataclasses.replace(msg, sampling_params=params)
            cfg = self.cfg
            req = Req.from_message(
                choice, cfg.eos_token_ids, self._arrivals, cfg.vocab_size, cfg.media_token_ids
            )
            req.index, req.fork_of = index, first
            first = first or req
            self.queue_request(req, problem)

    def take_pixels(self, msg: ItemPixels) -> None:
        """The front end's answer to `PixelsWanted`: the waiting request gets its keyed items'
        pixels and may be admitted again (a request that ended meanwhile: nothing to do)."""
        for req in self.waiting:
            if req.rid != msg.rid or req.mm is None:
                continue
            for item in req.mm.items:
                if item.feature is None and item.hash in msg.features:
                    item.feature = msg.features[item.hash]
            req.wants_pixels = False

    def take_embeddings(self, msg: ItemEmbeddings) -> None:
        """The features of a request's awaited items (embedding rows, or pixels to encode
        here): checked as a request's inputs are, then its chunks over them may run. Every rank
        gets the same message in the same step, so they all decide alike; for a request that
        has ended nothing is left to fill and the message is dropped."""
        reqs = self.holding(msg.rid)
        problem = fill_awaited(reqs, msg)
        for req in reqs:
            if problem:
                self.fail(req, f"media from the encoder server: {problem}")
            req.waits_for_items = False

    def holding(self, rid: str) -> list[Req]:
        """The choices of request `rid` the scheduler still holds, wherever they are."""
        chunked = [self.chunked] if self.chunked is not None else []
        every = [*self.waiting, *self.parked, *chunked, *self.running]
        return [r for r in every if r.rid == rid and not r.finished]

    def queue_request(self, req: Req, problem: str = "") -> None:
        self._started.append(ReqStart.of(req.rid, req.params, req.index))
        problem = problem or self.refusal(req)
        if problem:
            self.counters.refused += 1
            req.abort(FinishKind.ERROR, problem)
            req.refused = True
            self.touch(req)
            return
        self.waiting.append(req)

    def refusal(self, req: Req) -> str:
        """Why this request can never run here ("" when it can): refused up front, not retried."""
        if req.prompt_len == 0:
            return "empty prompt"
        if problem := self.grammar.refusal(req):
            return problem
        for name, ids in req.params.token_ids_named().items():
            if any(not 0 <= t < self.cfg.vocab_size for t in ids):
                return f"{name} names a token id outside the vocabulary [0, {self.cfg.vocab_size})"
        return self.budget.problem(req.prompt_len, req.params.max_new_tokens)

    @property
    def budget(self) -> TokenBudget:
        """The front door's rule (runtime/token_budget.py), asked again as a guard."""
        shared = not self.radix.disable
        return TokenBudget(self.cfg.context_length, self.cache.kv_total, shared)

    def abort(self, rid: str, index: int | None = None) -> None:
        """End the request's choices (`index`: that choice only)."""

        def named(req: Req) -> bool:
            return req.rid == rid and index in (None, req.index)

        for req in [r for r in self.waiting if named(r)]:
            self.waiting = [r for r in self.waiting if r is not req]
            req.abort()
            self.touch(req)
            self.counters.aborted += 1
        for req in [*self.running, *self.parked, *([self.chunked] if self.chunked else [])]:
            if named(req):
                req.abort()
                self.counters.aborted += 1
                self.finish_request(req)

    # ------------------------------------------------------------------ prefill
    def schedule_prefill(self) -> PrefillBatch | None:
        self.resume_parked()
        if not self.waiting and self.chunked is None:
            return None
        for req, problem in self.grammar.poll(self.waiting):
            req.refused = True
            self.fail(req, problem)
        adder, batch = self.make_adder(), PrefillBatch()
        if self.chunked is not None:
            chunked = self.chunked
            cut, ready = self.chunk_rule(chunked), chunked.ready_len
            n = adder.add(*admission_size(chunked), cut=cut, ready=ready)
            if n is None:
                self.unpark_for_kv()
                return None  # the chunked request waits for KV; decode frees some meanwhile
            batch.add(chunked, n)
            batch.patches += chunked.patches_entered(chunked.kv_len, chunked.kv_len + n)
            self.chunked = None
        considered = self.admit_waiting(batch, adder)
        taken = set(batch.reqs)
        self.waiting = [r for r in self.waiting if r not in taken]
        for req in considered:
            req.waited += req not in taken
        return batch or None

    def resume_parked(self) -> None:
        """A parked request whose awaited item arrived continues as the chunked request, once
        no other request is cut (the earliest arrival first)."""
        if self.chunked is not None:
            return
        ready = [r for r in self.parked if r.ready_len > 0]
        if ready:
            self.chunked = min(ready, key=lambda r: r.arrival)
            self.parked = [r for r in self.parked if r is not self.chunked]

    def unpark_for_kv(self) -> None:
        """The chunked request lacks KV and nothing decodes to free some: the latest parked
        request gives its KV to the tree (evictable there) and waits again, so the parked
        requests never hold the pool against the one that can run."""
        if self.running or not self.parked:
            return
        victim = max(self.parked, key=lambda r: r.arrival)
        self.parked = [r for r in self.parked if r is not victim]
        self.cache.release(victim)
        victim.waited = 0
        self.waiting.append(victim)
        self.counters.unparked += 1

    def admit_waiting(self, batch: PrefillBatch, adder: PrefillAdder) -> list[Req]:
        """Admit the waiting requests that can run, in order, until the step is full; returns
        those it considered. Once one waits for KV, the free KV is kept for it: a request
        behind it is tried only after it has waited PREEMPT_AFTER_STEPS steps itself (then it
        takes free KV, or preempts a larger holder), and only TRIES_BEHIND_A_WAIT of them."""
        considered = [r for r in self.ordered_waiting() if self.can_run(r)]
        waiting_for_kv, tries = False, 0
        for req in considered:
            if self.shares_batch_prefix(batch, req):
                continue
            if waiting_for_kv:
                if req.waited < PREEMPT_AFTER_STEPS:
                    continue
                tries += 1
                if tries > TRIES_BEHIND_A_WAIT:
                    break
            if self.admit_into(batch, req, adder) or self.preempt_for(batch, req, adder):
                continue
            if not adder.open:
                break  # no slot or prompt budget left: nobody else can join this step
            waiting_for_kv = True
        return considered

    def can_run(self, req: Req) -> bool:
        """Not waiting for pixels, an item's embedding, its first choice's prompt, or its
        grammar."""
        waits = req.wants_pixels or req.waits_for_items
        return not waits and ready(req) and self.grammar.is_ready(req)

    def preempt_for(self, batch: PrefillBatch, req: Req, adder: PrefillAdder) -> bool:
        """Admission held `req` back for lack of KV: it takes KV from the running requests
        that hold more than its whole size, prompt and remaining output (a small request from
        a big one: `schedule_policy.admission_victim`, only once it has waited long enough),
        one retraction at a time, until it is admitted; False when none is left to take from."""
        if not adder.open:
            return False
        size = len(req.token_ids) + req.remaining_new_tokens
        while (victim := admission_victim(size, req.waited, self.holders())) is not None:
            self.take_kv_from(self.running[victim], adder)
            if self.admit_into(batch, req, adder):
                return True
        return False

    def take_kv_from(self, victim: Req, adder: PrefillAdder) -> None:
        """Retract a running request during admission; the adder gets what that gives back:
        its KV (now evictable in the tree), its reserve and its request slot."""
        before = self.cache.free_or_evictable()
        reserve = reserve_of(victim)
        self.retract(victim)
        self.counters.admission_preemptions += 1
        adder.grant(self.cache.free_or_evictable() - before + reserve, slots=1)

    def holders(self) -> list[Holder]:
        """The running requests as retraction weighs them: the KV each computed itself (its
        cached prefix, which other requests or its own forks may share, not counted)."""
        return [Holder(r.kv_len - r.cached_tokens, r.arrival, r.retractions) for r in self.running]

    def shares_batch_prefix(self, batch: PrefillBatch, req: Req) -> bool:
        """The request's uncached prompt starts like one this step computes: it waits a step
        (that prompt goes into the tree when its prefill ends) instead of computing the same
        tokens, an image's among them, a second time."""
        if self.radix.disable or not batch:
            return False
        computed = [(r.token_ids, r.kv_len + n) for r, n in batch.chunks()]
        key = req.prefix_key()
        if not may_share(key, computed):  # no tree match needed: nothing to share
            return False
        sharer = batch_sharer(key, self.cache.cached_prefix_len(req), computed)
        if sharer is None:
            return False
        batch.reqs[sharer].shares_prompt = True
        self.counters.deferred_to_share += 1
        return True

    def admit_into(self, batch: PrefillBatch, req: Req, adder: PrefillAdder) -> bool:
        """Lock the request's cached prefix and add its next chunk to the batch; False (and
        nothing held) when it does not fit: admission stops there."""
        locked = self.cache.lock(req)
        if locked is None:
            return False
        if req.ready_len <= 0:  # its cached prefix ends inside an item not yet arrived
            self.cache.unlock(req)
            req.waits_for_items = True
            return True
        if self.wait_for_pixels(req):
            return True  # it holds nothing now; admission goes on with the next request
        if self.over_encoder_budget(batch, req, adder):
            self.cache.unlock(req)
            return True  # it leads the next step's media; text prompts behind it go on now
        adder.rem_total -= locked  # its cached prefix is no longer evictable
        n = adder.add(*admission_size(req), cut=self.chunk_rule(req), ready=req.ready_len)
        if n is None:
            self.cache.unlock(req)
            return False
        batch.add(req, n)
        batch.patches += req.patches_entered(req.kv_len, req.kv_len + n)
        return True

    def chunk_rule(self, req: Req) -> Callable[[int], int] | None:
        """How a chunk of the request moves off the inside of a media item, where the family's
        items attend both ways (`Req.item_safe_chunk`); None where any cut is exact."""
        if req.mm is None or not getattr(self.runner, "bidirectional_items", False):
            return None
        return req.item_safe_chunk

    def over_encoder_budget(self, batch: PrefillBatch, req: Req, adder: PrefillAdder) -> bool:
        """The images and videos this request's chunk would encode do not fit the step's
        encoder budget (`max_encoder_patches_per_step`) next to those already in it. A step
        always takes its first media request, so the budget only splits several across steps:
        a prefill step's length is bounded by about one item's encoder time, and the running
        requests' next tokens (riding along, with mixed steps) and the text prompts admitted
        past it do not wait for a whole burst of images to be encoded."""
        budget = self.cfg.max_encoder_patches_per_step
        if budget <= 0 or batch.patches == 0 or req.mm is None:
            return False
        chunk = min(req.extend_len, adder.chunk_size, adder.rem_input)
        need = req.patches_entered(req.kv_len, req.kv_len + chunk)
        if need == 0 or batch.patches + need <= budget:
            return False
        self.counters.encoder_deferred += 1
        return True

    def wait_for_pixels(self, req: Req) -> bool:
        """Items the request sent by key that some rank's encoder cache no longer holds (an
        eviction since the front end sent it): the request gives its lock back and waits for
        their pixels, which rank 0 asks the front end for; it never fails for this."""
        missing = self.cache.hold_keyed_items(req, self.tp)
        if not missing:
            return False
        self.cache.unlock(req)
        req.wants_pixels = True
        self.counters.pixels_wanted += 1
        self._asks.append(PixelsWanted(req.rid, missing))
        return True

    def make_adder(self) -> PrefillAdder:
        reserved = sum(reserve_of(r) for r in self.running)
        return PrefillAdder(
            rem_total=self.cache.free_or_evictable() - reserved,
            rem_input=self.prefill_budget(),
            chunk_size=self.cfg.chunked_prefill_size,
            rem_reqs=self.cfg.max_running_requests - len(self.running),
        )

    def prefill_budget(self) -> int:
        """Prompt tokens the next prefill step may compute. While requests decode inside
        prefill steps (mixed steps), a step's length is what each of them waits for its next
        token, so a step computes at most one chunk (--chunked-prefill-size) in all; with
        nothing running, or without mixed steps (the decodes then wait for every prefill step
        until the queue is empty, so more, shorter steps would only make them wait longer), a
        whole --max-prefill-tokens batch."""
        if self.cfg.enable_mixed_chunk and self.running:
            return min(self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size)
        return self.cfg.max_prefill_tokens

    def ordered_waiting(self) -> list[Req]:
        if self.cfg.schedule_policy == "lpm" and not self.radix.disable:
            keyed = [(self.cache.cached_prefix_len(r), r) for r in self.waiting]
            return [r for _, r in sorted(keyed, key=lambda x: (-x[0], x[1].arrival))]
        return sorted(self.waiting, key=lambda r: r.arrival)

    def riding_decodes(self, batch: PrefillBatch) -> list[Req]:
        """Mixed steps: the running requests decode in the prefill's forward when their tokens
        fit in KV next to the chunk (else they wait for the next step, as without mixing)."""
        if not (self.cfg.enable_mixed_chunk and self.running):
            return []
        riding = [r for r in self.running if r.extend_len == 1]  # not a jump-forward run
        if self.cache.free_or_evictable() < batch.new_tokens + len(riding):
            return []
        return riding

    def run_prefill(self, batch: PrefillBatch) -> None:
        """Prefill a chunk of each request (and, in a mixed step, decode one token of each of
        the batch's decodes in the same forward); sample the requests whose prompt is done."""
        batch = batch.keep(self.isolate(batch.everyone))
        if not batch:
            return
        self.count_prefill(batch)
        self.cache.ensure_free(batch.new_tokens)
        for req, n in batch.chunks():
            self.cache.pin_items_in_progress(req, req.kv_len + n)
        logits = self.forward_prefill(batch)
        done = batch.prompts_done()
        for req in batch.cut():
            self.cache.insert_computed(req)
            self.park_or_chunk(req)
        sampling, rows = batch.sampled()
        if rows:
            self.sample_and_append(sampling, logits[rows])
        now = time.perf_counter()
        for req in done:
            self.cache.set_encoder_pins(req, frozenset())  # its items are all read
            self.share_prompt(req)
            if req.retractions == 0:
                self.counters.cached_prompt_tokens += req.cached_tokens
                req.clock.first_token(now)
            if not req.finished:
                self.running.append(req)

    def park_or_chunk(self, req: Req) -> None:
        """A cut request goes on next step (chunked), or, when its next token is inside an item
        whose embedding has not arrived, is parked with its KV until `take_embeddings`, so
        other requests are cut and prefill meanwhile."""
        if req.ready_len > 0:
            self.chunked = req
            return
        self.parked.append(req)
        self.counters.parked += 1

    def share_prompt(self, req: Req) -> None:
        """A request with forks waiting, or one that requests waiting a step to share its
        prompt start (`shares_batch_prefix`): its prompt goes into the radix tree now, so they
        match it (a fork prefills only its last token; images are not encoded again)."""
        forks = any(r.fork_of is req for r in self.waiting)
        if req.finished or not (req.shares_prompt or forks):
            return
        self.cache.insert_computed(req)

    def forward_prefill(self, batch: PrefillBatch) -> torch.Tensor:
        """The step's forward; each request's clock takes the step's start and, when its chunk
        holds media, the encoder time of the step (timing only, never a decision)."""
        start, encoded = time.perf_counter(), self.encoder_cache.counters.encode_seconds
        media = [chunk_holds_media(r, r.kv_len, r.kv_len + n) for r, n in batch.chunks()]
        logits = self.runner.mixed(batch.reqs, batch.lens, batch.decodes)
        encoder = self.encoder_cache.counters.encode_seconds - encoded
        for req, has_media in zip(batch.reqs, media):
            req.clock.prefill_step(start, encoder if has_media else 0.0)
        return logits

    def count_prefill(self, batch: PrefillBatch) -> None:
        self.counters.prefill_steps += 1
        self.counters.mixed_steps += bool(batch.decodes)
        self.counters.prompt_tokens_computed += sum(batch.lens)
        self.counters.recomputed_tokens += sum(n for r, n in batch.chunks() if r.retractions)

    # ------------------------------------------------------------------ decode
    def run_decode(self) -> None:
        if self.overlap is not None and self.decode_overlapped():
            return
        self.resolve_in_flight()
        self.counters.decode_steps += 1
        self.make_room_for_decode()
        if not self.running:
            return
        self.isolate(list(self.running))
        if not self.running:
            return
        self.cache.ensure_free(decode_tokens(self.running))
        self.sample_and_append(*self.forward_decode(self.running))

    def forward_decode(self, reqs: list[Req]) -> tuple[list[Req], torch.Tensor]:
        """One token of each request; a request with a jump-forward run computes the run (its
        sampled token and the tokens its grammar forced after it) as an extend in the same
        forward. Returns the requests in the logits' row order, and the logits."""
        jumps = [r for r in reqs if r.extend_len > 1]
        if not jumps:
            return list(reqs), self.runner.decode(reqs)
        singles = [r for r in reqs if r.extend_len == 1]
        logits = self.runner.mixed(jumps, [r.extend_len for r in jumps], singles)
        return [*jumps, *singles], logits

    def decode_overlapped(self) -> bool:
        """Launch the next decode step, then read the one in flight (scheduler/overlap.py);
        False, with nothing done, when this step cannot run that way."""
        assert self.overlap is not None
        flight = self.in_flight
        reqs = [r for r in self.running if continues(r, flight is not None)]
        held = {id(r) for r in flight.reqs} if flight is not None else None
        if held is not None and any(id(r) not in held for r in reqs):
            return False
        if reqs and not self.overlap.can_run(reqs):
            return False
        if len(reqs) > self.cache.free_or_evictable() or not (reqs or flight):
            return False
        self.in_flight = None
        if reqs:
            self.counters.decode_steps += 1
            reqs = self.isolate(reqs)  # as a synchronous decode: a failed request is not run
        if reqs:
            self.cache.ensure_free(len(reqs))
            self.in_flight = self.overlap.launch(reqs, flight)
        if flight is not None:
            self.append_read(flight)
        return True

    def resolve_in_flight(self) -> None:
        """Read and append the tokens of the decode step in flight, if there is one."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            self.append_read(flight)

    def append_read(self, flight: InFlight) -> None:
        """The tokens of a step launched without a host read, appended as `sample_and_append`
        would (a request that ended while the step ran skips its row)."""
        tokens, bad = flight.read()
        for req, token, failed in zip(flight.reqs, tokens, bad):
            if req.finished:
                continue
            if failed:
                self.fail(req, NON_FINITE)
                continue
            req.append_token(token)
            self.took_step(req)

    def make_room_for_decode(self) -> None:
        """Retract until one step of decode fits in KV: the request that holds the most first
        (`schedule_policy.retraction_victim`), so a small request is not pushed out for a big
        one."""
        while self.running and self.cache.free_or_evictable() < decode_tokens(self.running):
            victim = retraction_victim(self.holders())
            assert victim is not None
            self.retract(self.running[victim])

    def retract(self, req: Req) -> None:
        """Its KV goes to the tree (evictable), it waits again; it is recomputed from what the
        tree still holds of it when all it needs fits (`PrefillAdder.add`)."""
        self.counters.retractions += 1
        self.running = [r for r in self.running if r is not req]
        self.cache.release(req)
        req.retractions += 1
        req.waited = 0
        self.waiting.append(req)
        logger.debug("retracted %s after %d output tokens", req.rid, len(req.output_ids))

    # ------------------------------------------------------------------ tokens and finishing
    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Rank 0 samples (a row that cannot be sampled fails its request) and broadcasts the
        tokens and failures, so every rank appends and fails the same (invariant 9)."""
        picked, logprobs = None, {}
        if self.tp.is_first:
            picked = self.sample(reqs, logits)
            logprobs = token_logprobs(logits, [r.params for r in reqs], picked[0])
            picked = (*picked, *self.grammar.advance(reqs, *picked))
        tokens, errors, ended, forced = self.tp.broadcast_pyobj(picked)
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if i in errors:
                self.fail(req, errors[i])
                continue
            if i in logprobs:
                req.logprobs.append(logprobs[i])
            req.append_token(int(token))
            self.append_forced(req, forced.get(i, []))
            if i in ended and not req.finished:
                req.finish = FinishKind.STOP  # the grammar can only end here
            self.took_step(req)

    def took_step(self, req: Req) -> None:
        """A request's token of this step is appended: count it, report it, end it if done."""
        self.counters.generated_tokens += 1
        self.touch(req)
        if req.finished:
            self.finish_request(req)

    def append_forced(self, req: Req, run: list[int]) -> None:
        """Jump-forward: the tokens the grammar forced after the sampled one, each appended as
        if sampled (stop tokens and max_tokens end it as usual); each saves a decode step."""
        for token in run:
            if req.finished:
                return
            req.append_token(token)
            self.counters.generated_tokens += 1
            self.counters.forced_tokens += 1

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[int], StepErrors]:
        """Each row's token; a row whose grammar failed at its mask fill, or that cannot be
        sampled, maps to why in the errors (its token is thrown away)."""
        params = [r.params for r in reqs]
        steps = [len(r.token_ids) - r.prompt_len for r in reqs]
        mask, faults = self.grammar.mask(reqs, logits.shape[-1])
        if mask is not None:
            logits = logits.clone()
            apply_bitmask(logits, mask)
        controls = None
        if any(p.uses_controls for p in params):
            controls = RowControls([r.sampling for r in reqs], [r.stop_ids for r in reqs])
        tokens, errors = self.sampler.sample_safe(logits, params, steps, controls)
        return tokens, {**errors, **faults}

    # ------------------------------------------------------------------ fault isolation
    def isolate(self, reqs: list[Req]) -> list[Req]:
        """Check each request's inputs on this rank, agree across ranks on which failed, fail
        those on every rank alike; returns the others in order (invariant 11)."""
        errors = {i: problem for i, r in enumerate(reqs) if (problem := self.input_problem(r))}
        if not (self.faults is not None or any(self.needs_input_check(r) for r in reqs)):
            return reqs  # nothing could fail here, on any rank: no collective needed
        failed = self.agree_on_failures(len(reqs), errors)
        for i, rank in failed.items():
            self.fail(reqs[i], f"request fault on TP rank {rank}: {errors.get(i, 'see its log')}")
        return [r for i, r in enumerate(reqs) if i not in failed]

    def input_problem(self, req: Req) -> str:
        """Why this request cannot run its next forward ("" when it can); logged with its rid."""
        if self.faults is not None:
            self.counters.faults_injected += self.faults.hits(req)
        try:
            if self.needs_input_check(req):
                check_inputs(req)
            if self.faults is not None:
                self.faults.check(req)
        except Exception as exc:  # noqa: BLE001 - this request's fault, reported as its error
            logger.warning("request %s failed its input check: %r", req.rid, exc)
            return repr(exc)
        return ""

    @staticmethod
    def needs_input_check(req: Req) -> bool:
        """Once, before its first chunk (the same answer on every rank)."""
        return req.kv_len <= req.cached_tokens and req.retractions == 0

    def agree_on_failures(self, n: int, errors: dict[int, str]) -> dict[int, int]:
        """Index -> the highest TP rank that failed it, agreed by every rank (max all-reduce)."""
        if self.tp.size == 1:
            return {i: 0 for i in errors}
        flags = torch.zeros(n, dtype=torch.int64)
        for i in errors:
            flags[i] = self.tp.rank + 1
        flags = self.tp.all_reduce_cpu(flags, op="max")
        return {i: int(f) - 1 for i, f in enumerate(flags.tolist()) if f}

    def fail(self, req: Req, why: str | GrammarFault) -> None:
        """End the request with an error; free its slot, pins and KV without caching its KV.
        A grammar fault is the client's: a refusal naming the constraint's field (a 400)."""
        if isinstance(why, GrammarFault):
            req.refused, req.refused_param, why = True, why.param, why.detail
        req.abort(FinishKind.ERROR, why)
        self.counters.failed += 1
        self.waiting = [r for r in self.waiting if r is not req]
        self.running = [r for r in self.running if r is not req]
        self.parked = [r for r in self.parked if r is not req]
        if self.chunked is req:
            self.chunked = None
        self.cache.release_failed(req)
        self.touch(req)

    def touch(self, req: Req) -> None:
        """Report this request's news (tokens, finish) in this step's outputs."""
        self._touched[req] = None

    def finish_request(self, req: Req) -> None:
        self.running = [r for r in self.running if r is not req]
        self.parked = [r for r in self.parked if r is not req]
        if self.chunked is req:
            self.chunked = None
        self.cache.release(req)
        self.counters.finished += req.finish in (FinishKind.STOP, FinishKind.LENGTH)
        self.touch(req)

    def collect_outputs(self) -> list[ReqOutput]:
        outputs = []
        for req in self._touched:
            new = req.outputs_from(req.sent_len)
            logprobs = req.logprobs[req.sent_len :] if req.params.logprobs is not None else None
            req.sent_len = req.output_len
            finish = req.outcome() if req.finished else None
            if req.finished:
                self.grammar.drop(req)
            outputs.append(
                ReqOutput(
                    req.rid,
                    new,
                    req.prompt_len,
                    req.output_len,
                    req.cached_tokens,
                    finish,
                    req.clock.take_report(),
                    logprobs,
                    req.index,
                )
            )
        self._touched = {}
        return outputs

    # ------------------------------------------------------------------ the cache, as a whole
    def check_idle_accounting(self) -> None:
        self.cache.check_idle()

    def flush_cache(self) -> FlushCacheOut:
        if not self.idle:
            return FlushCacheOut(False, "requests are running; flush refused")
        self.cache.flush()
        return FlushCacheOut(True)

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            **self.cache.kv_usage(),
            running=len(self.running) + len(self.parked) + (self.chunked is not None),
            waiting=len(self.waiting),
            radix=self.cache.radix_stats(),
            encoder_cache=self.cache.encoder_stats(),
            counters=dataclasses.replace(self.counters),
            encoder_plans=dict(self.runner.model.plan_counts),
            gc_frozen=frozen_startup_objects(),
        )


def decode_tokens(reqs: list[Req]) -> int:
    """KV slots the next decode step writes: one per request, a jump-forward run's length for
    a request that has one."""
    return sum(r.extend_len for r in reqs)


def reserve_of(req: Req) -> int:
    """The KV a running request keeps for its next tokens (`schedule_policy.decode_reserve`)."""
    return decode_reserve(req.remaining_new_tokens, req.retractions > 0)


def admission_size(req: Req) -> tuple[int, int, int, bool]:
    """What `PrefillAdder.add` weighs for this request."""
    return req.extend_len, req.remaining_new_tokens, req.arrival, req.retractions > 0


def choice_params(p: SamplingParams) -> list[SamplingParams]:
    """Each of the request's n choices samples on its own (n=1); choice i of a seeded request
    draws with seed + i."""
    if p.n == 1:
        return [p]
    return [
        dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i) for i in range(p.n)
    ]


def ready(req: Req) -> bool:
    """A fork waits until the first choice's prompt is cached (it has sampled) or it ended."""
    first = req.fork_of
    return first is None or first.finished or len(first.token_ids) > first.prompt_len


def fill_awaited(reqs: list[Req], msg: ItemEmbeddings) -> str:
    """Put the message's features on the requests' awaited items (a request's choices share
    one item list); why they cannot be fused ("" when they can)."""
    for req in reqs:
        prompt = req.token_ids[: req.prompt_len]
        for item in req.mm.items if req.mm is not None else []:
            if not (item.awaiting and item.hash in msg.features):
                continue
            item.feature, item.embedded = msg.features[item.hash], msg.embedded
            item.awaiting = False
            try:
                check_item(item, prompt)
            except ValueError as exc:
                return str(exc)
    return ""


def chunk_holds_media(req: Req, start: int, end: int) -> bool:
    return req.mm is not None and any(overlaps(item, start, end) for item in req.mm.items)
