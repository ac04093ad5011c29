"""Which waiting requests join the next prefill batch, and how many of their tokens; which
running request gives its KV back when the pool is full.

Pure logic over numbers, so every rule is unit-tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Share of a request's remaining output budget reserved in KV when it is admitted; retraction
# covers the rest when outputs run longer than the estimate.
NEW_TOKEN_RATIO = 0.5
# Reservations are capped per request so one huge max_tokens does not block admission.
RESERVE_CLIP = 512

# A request retracted this many times is not retracted again while another one can be (decode
# retracts it anyway when every running request has been: the pool must never stall), and is
# never taken for another's admission: no request is recomputed over and over.
MAX_RETRACTIONS = 2
# Steps a waiting request is held back for lack of KV before it may take KV from a running
# request that holds more than it needs (`admission_victim`); also how long a request behind
# one that waits for KV waits before it may take free KV ahead of it.
PREEMPT_AFTER_STEPS = 8
# Requests behind one that waits for KV that admission tries in one step (bounds the work of a
# step whatever the length of the queue).
TRIES_BEHIND_A_WAIT = 4


# A waiting request whose uncached prompt starts with this many tokens that a request of the
# batch computes now waits one step, then finds them in the tree (see `batch_sharer`).
IN_BATCH_SHARE_TOKENS = 32


def decode_reserve(remaining_new_tokens: int, retracted: bool = False) -> int:
    """KV kept for a request's next tokens: a share of its remaining budget, clipped, until it
    has been retracted once; then all of it, so that the requests admitted after it cannot
    squeeze it out again (it re-enters only when that much fits, see `PrefillAdder.add`)."""
    if retracted:
        return remaining_new_tokens
    return math.ceil(min(remaining_new_tokens, RESERVE_CLIP) * NEW_TOKEN_RATIO)


@dataclass(frozen=True)
class Holder:
    """A running request as retraction sees it."""

    held: int  # KV tokens it holds and computed itself (not its cached prefix)
    arrival: int
    retractions: int


def retraction_victim(holders: Sequence[Holder]) -> int | None:
    """The running request to retract when a decode step does not fit the KV pool: the one
    that holds the most (it frees the most, and a small request is never pushed out for a big
    one), ties to the newest arrival; among those retracted fewer than MAX_RETRACTIONS times
    while there are any. None when nothing runs."""
    fresh = [i for i, h in enumerate(holders) if h.retractions < MAX_RETRACTIONS]
    return _largest(holders, fresh or list(range(len(holders))))


def admission_victim(size: int, waited: int, holders: Sequence[Holder]) -> int | None:
    """The running request that a waiting request takes KV from when admission holds it back
    for lack of KV (preemption for admission): only once it has waited PREEMPT_AFTER_STEPS
    steps, and only from a request that already holds twice the waiting one's whole `size` (its
    prompt and remaining output) or more: a small request takes from a big one, never from one
    of about its own size that is further along (that would only trade one for the other and
    recompute it); and only from one retracted fewer than MAX_RETRACTIONS times. The largest
    such; None: it waits."""
    if waited < PREEMPT_AFTER_STEPS:
        return None
    fresh = [
        i for i, h in enumerate(holders) if h.retractions < MAX_RETRACTIONS and h.held >= 2 * size
    ]
    return _largest(holders, fresh)


def _largest(holders: Sequence[Holder], among: Sequence[int]) -> int | None:
    if not among:
        return None
    return max(among, key=lambda i: (holders[i].held, holders[i].arrival))


def may_share(key: Sequence[int], computed: Sequence[tuple[Sequence[int], int]]) -> bool:
    """Whether `batch_sharer` can find a sharer for `key` whatever the tree caches of it: a
    sharer holds `key`'s first IN_BATCH_SHARE_TOKENS tokens at least, so a batch where none
    does needs no prefix match in the tree (the common case: requests with their own prompts)."""
    head = list(key[:IN_BATCH_SHARE_TOKENS])
    if len(head) < IN_BATCH_SHARE_TOKENS:
        return False
    return any(
        held >= IN_BATCH_SHARE_TOKENS and list(tokens[:IN_BATCH_SHARE_TOKENS]) == head
        for tokens, held in computed
    )


def batch_sharer(
    key: Sequence[int], cached: int, computed: Sequence[tuple[Sequence[int], int]]
) -> int | None:
    """Which of the batch's requests (`computed[i]`: request i's tokens and how many of them it
    holds in KV once this step has run) also holds `key[:cached + IN_BATCH_SHARE_TOKENS]`: the
    `cached` tokens the tree gives this request and the next ones it would compute itself; None
    when none does, or when fewer tokens than that are left to share.

    Admitting such a request in the same step computes the shared tokens twice (a wave of chats
    on one image prefills the image once per chat); one step later they are in the tree. The
    window after `cached` is compared first, so a request that shares nothing costs a 32-token
    comparison per batch member."""
    end = cached + IN_BATCH_SHARE_TOKENS
    if len(key) < end:
        return None
    window = list(key[cached:end])
    for i, (tokens, held) in enumerate(computed):
        if held >= end and list(tokens[cached:end]) == window:
            if list(tokens[:cached]) == list(key[:cached]):
                return i
    return None


@dataclass
class PrefillAdder:
    """Admits requests in the given order until a budget runs out.

    rem_total: KV tokens that may still be taken (free + evictable - reserved decode room).
    rem_input: prompt tokens this batch may still compute (`Scheduler.prefill_budget`:
        --max-prefill-tokens, or one --chunked-prefill-size while requests decode in mixed steps).
    chunk_size: the most prompt tokens one request may compute in one step (--chunked-prefill-size).
    rem_reqs: request slots left (--max-running-requests minus running).

    A request is not cut into a batch in which the prompt of an earlier arrival ends: a step
    that finishes one request's prompt (the rest of a chunked one, or a whole one) would
    otherwise also compute the first chunk of the next long prompt, and the finished request's
    first token would wait for that chunk, while the cut request's own first token comes no
    sooner (its prompt needs a later step either way, and the work in between is the same). Two
    3,400-token prompts with 2,048-token chunks: the first one's first token after 3,400 tokens
    of prefill, not 5,448. A later arrival that ends first (the "lpm" order puts cached prompts
    ahead) never holds an earlier one back: that could starve a long prompt behind a stream of
    cached short ones.
    """

    rem_total: int
    rem_input: int
    chunk_size: int
    rem_reqs: int
    chunked: bool = False  # a request was cut in this batch: nothing may follow it
    ended: int | None = None  # the earliest arrival whose prompt ends in this batch

    def add(
        self,
        extend_len: int,
        remaining_new_tokens: int,
        arrival: int = 0,
        retracted: bool = False,
        cut: Callable[[int], int] | None = None,
        ready: int | None = None,
    ) -> int | None:
        """Tokens of this request to compute now (all, or a chunk), or None if it must wait. A
        retracted request enters only when all it still needs fits: its tokens to recompute
        and its whole remaining output. `cut` moves a chunk's length off the inside of a media
        item (`Req.item_safe_chunk`): shorter, or longer (past the chunk size) when the item
        began before the chunk; a chunk that would then not fit the KV waits. `ready`: the
        tokens that may run now (`Req.ready_len`: up to an item whose embedding has not
        arrived); fewer than `extend_len` make this step a cut of at most that many."""
        ready = extend_len if ready is None else ready
        if not self.open or extend_len <= 0 or ready <= 0:
            return None
        reserve = decode_reserve(remaining_new_tokens, retracted)
        if retracted and extend_len + reserve > self.rem_total:
            return None
        whole = extend_len <= min(self.chunk_size, self.rem_input, ready)
        if whole and extend_len + reserve <= self.rem_total:
            self.ended = arrival if self.ended is None else min(self.ended, arrival)
            return self._take(extend_len, reserve)
        room = min(self.chunk_size, self.rem_input, self.rem_total - reserve, extend_len - 1, ready)
        if cut is not None and room >= 1:
            room = cut(room)
            if room >= extend_len:  # the item runs to the prompt's end: all of it, if it fits
                if extend_len + reserve > self.rem_total:
                    return None
                self.ended = arrival if self.ended is None else min(self.ended, arrival)
                return self._take(extend_len, reserve)
            if room > self.rem_total - reserve:
                return None  # the item's whole run does not fit the KV now
        if room < 1 or (self.ended is not None and self.ended <= arrival):
            return None
        self.chunked = True
        return self._take(room, 0)

    @property
    def open(self) -> bool:
        """Another request may still join: a slot is left, no request was cut, prompt budget
        is left. When admission fails while open, KV is what it lacks."""
        return self.rem_reqs > 0 and not self.chunked and self.rem_input > 0

    def grant(self, kv_tokens: int, slots: int = 0) -> None:
        """KV (and request slots) a retraction gave back during admission."""
        self.rem_total += kv_tokens
        self.rem_reqs += slots

    def _take(self, tokens: int, reserve: int) -> int:
        self.rem_total -= tokens + reserve
        self.rem_input -= tokens
        self.rem_reqs -= 1
        return tokens
