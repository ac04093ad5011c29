"""A matcher that lets a reasoning model think freely and constrains only what follows.

Until the end-of-thinking token (`</think>`) is accepted, every token is allowed and the inner
grammar does not move; from the token after it, the inner matcher decides. Rollback may cross the
boundary: the model is then thinking again and the inner matcher is back at its start.
"""

from __future__ import annotations

import torch

from runtime.grammar.base import GrammarMatcher, JumpForward


class ReasoningMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, think_end_id: int, thinking: bool = True) -> None:
        self.inner = inner
        self.think_end_id = think_end_id
        self._accepted = 0
        # tokens accepted up to and including the end of thinking; None while thinking
        self._grammar_from: int | None = None if thinking else 0

    @property
    def thinking(self) -> bool:
        return self._grammar_from is None

    def accept_token(self, token: int) -> bool:
        if not self.thinking and not self.inner.accept_token(token):
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
            if kept < self._grammar_from:
                self._grammar_from = None
        self._accepted = kept

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.thinking:
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
