"""A matcher that lets a reasoning model think freely and constrains only what follows.

Until the end-of-thinking token (`</think>`) is accepted, every token is allowed and the inner
grammar does not move; from the token after it, the inner matcher decides. With a start token
(`<think>`, the qwen3 rule) the reply thinks only if it opens with that token: at the first
position the mask allows it and whatever the grammar allows, and any other first token starts
the grammar at once. Rollback may cross either boundary: the matcher is then back where it was.
"""

from __future__ import annotations

import torch

from runtime.grammar.base import GrammarMatcher, JumpForward, ThinkSection


class ReasoningMatcher(GrammarMatcher):
    def __init__(
        self,
        inner: GrammarMatcher,
        think_end_id: int,
        thinking: bool = True,
        think_start_id: int | None = None,
    ) -> None:
        self.inner = inner
        self.think_end_id = think_end_id
        self.think_start_id = think_start_id  # set: the first token decides (see the module)
        self._accepted = 0
        self._initial: int | None = None if thinking else 0
        # tokens accepted before the grammar's first one; None while thinking
        self._grammar_from: int | None = self._initial

    @classmethod
    def around(cls, inner: GrammarMatcher, think: ThinkSection) -> ReasoningMatcher:
        return cls(inner, think.end_id, think_start_id=think.start_id)

    @property
    def thinking(self) -> bool:
        return self._grammar_from is None

    @property
    def deciding(self) -> bool:
        """At the first position of a reply that may open a thinking section or may not."""
        return self.think_start_id is not None and self.thinking and self._accepted == 0

    def accept_token(self, token: int) -> bool:
        if self.deciding and token != self.think_start_id:
            self._grammar_from = 0  # no thinking section: the grammar starts here
        if not self.thinking and not self.inner.accept_token(token):
            if self._accepted == 0:
                self._grammar_from = self._initial
            return False
        self._accepted += 1
        if self.thinking and token == self.think_end_id:
            self._grammar_from = self._accepted
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._accepted} tokens")
        kept = self._accepted - num_tokens
        if self._grammar_from is not None:
            self.inner.rollback(self._accepted - max(kept, self._grammar_from))
            if kept < self._grammar_from or kept == 0:
                self._grammar_from = self._initial
        self._accepted = kept

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.deciding:
            self.inner.fill_bitmask(bitmask, row)
            allow_token(bitmask, row, self.think_start_id)
        elif self.thinking:
            bitmask[row].fill_(-1)
        else:
            self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return not self.thinking and self.inner.is_terminated()

    def jump_forward(self) -> JumpForward:
        return JumpForward([], "") if self.thinking else self.inner.jump_forward()

    @property
    def num_accepted(self) -> int:
        return self._accepted

    def error(self) -> str | None:
        return self.inner.error()


def allow_token(bitmask: torch.Tensor, row: int, token: int | None) -> None:
    """Set `token`'s bit in `bitmask[row]` (int32 words: bit 31 is the sign bit)."""
    if token is None:
        return
    word, bit = divmod(token, 32)
    value = 1 << bit
    bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value
