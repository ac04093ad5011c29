"""Which waiting requests join the next prefill batch, and how many of their tokens.

Pure logic over numbers, so every rule is unit-tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Share of a request's remaining output budget reserved in KV when it is admitted; retraction
# covers the rest when outputs run longer than the estimate.
NEW_TOKEN_RATIO = 0.5
# Reservations are capped per request so one huge max_tokens does not block admission.
RESERVE_CLIP = 512


# A waiting request whose uncached prompt starts with this many tokens that a request of the
# batch computes now waits one step, then finds them in the tree (see `batch_sharer`).
IN_BATCH_SHARE_TOKENS = 32


def decode_reserve(remaining_new_tokens: int) -> int:
    return math.ceil(min(remaining_new_tokens, RESERVE_CLIP) * NEW_TOKEN_RATIO)


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

    def add(self, extend_len: int, remaining_new_tokens: int, arrival: int = 0) -> int | None:
        """Tokens of this request to compute now (all, or a chunk), or None if it must wait."""
        if self.rem_reqs <= 0 or self.chunked or extend_len <= 0:
            return None
        reserve = decode_reserve(remaining_new_tokens)
        whole = extend_len <= min(self.chunk_size, self.rem_input)
        if whole and extend_len + reserve <= self.rem_total:
            self.ended = arrival if self.ended is None else min(self.ended, arrival)
            return self._take(extend_len, reserve)
        room = min(self.chunk_size, self.rem_input, self.rem_total - reserve, extend_len - 1)
        if room < 1 or (self.ended is not None and self.ended <= arrival):
            return None
        self.chunked = True
        return self._take(room, 0)

    def _take(self, tokens: int, reserve: int) -> int:
        self.rem_total -= tokens + reserve
        self.rem_input -= tokens
        self.rem_reqs -= 1
        return tokens
