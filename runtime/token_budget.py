"""How many tokens one request may hold: the one rule for the context length.

`context_length` says which length is in force; `TokenBudget` what a request may hold under it.

The front door asks it before any work (and before any image is decoded, with the images'
tokens read from their headers); the scheduler asks it again as a guard for requests that reach
it directly. Both give the same answer because both ask this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.model_config import ModelConfig
    from runtime.server_args import ServerArgs


def context_length(args: ServerArgs, config: ModelConfig) -> int:
    """The context length in force: --context-length, else the checkpoint's position limit."""
    return args.context_length or config.text.max_position_embeddings


@dataclass(frozen=True)
class TokenBudget:
    """Prompt plus output tokens must fit the context length and the KV pool; the n choices of
    a request must fit the KV pool together."""

    context_length: int
    kv_tokens: int
    # The n choices of a request share its prompt's KV: with the radix cache on, choices 1..n-1
    # fork from the first one's cached prompt (scheduler.add_request); without it each choice
    # computes and holds the prompt itself.
    shared_prompt: bool = True

    @property
    def limit(self) -> int:
        return min(self.context_length, self.kv_tokens)

    def room(self, prompt_tokens: int, n: int = 1) -> int:
        """Output tokens left to each of n choices after a prompt of this length (may be zero
        or negative)."""
        one = self.limit - prompt_tokens
        if n == 1:
            return one
        if self.shared_prompt:
            return min(one, (self.kv_tokens - prompt_tokens) // n)
        return min(one, self.kv_tokens // n - prompt_tokens)

    def choices_tokens(self, prompt_tokens: int, max_new_tokens: int, n: int) -> int:
        """KV tokens n choices hold together at most: prompt + n x max_tokens when they share
        the prompt (radix cache on), n x (prompt + max_tokens) when each holds its own."""
        if self.shared_prompt:
            return prompt_tokens + n * max_new_tokens
        return n * (prompt_tokens + max_new_tokens)

    def problem(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """Why a request of this size can never run ("" when it fits)."""
        if prompt_tokens + max_new_tokens <= self.limit:
            return ""
        return (
            f"one request may hold {self.limit} tokens (context length {self.context_length}, "
            f"KV pool {self.kv_tokens}); the prompt has {prompt_tokens} tokens and "
            f"max_tokens asks for {max_new_tokens}"
        )

    def choices_problem(self, prompt_tokens: int, max_new_tokens: int, n: int) -> str:
        """Why a request's n choices can never run together ("" when they fit): they would
        hold more than the whole KV pool, so some would be retracted over and over (a single
        choice's own limit is `problem`'s)."""
        need = self.choices_tokens(prompt_tokens, max_new_tokens, n)
        if n <= 1 or need <= self.kv_tokens:
            return ""
        prompt = f" with a prompt of {prompt_tokens} tokens" if prompt_tokens else ""
        return (
            f"n={n} choices of max_tokens={max_new_tokens}{prompt} need {need} KV tokens "
            f"together; the KV pool holds {self.kv_tokens}: lower n or max_tokens"
        )
