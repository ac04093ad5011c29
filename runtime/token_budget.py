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
    """Prompt plus output tokens must fit the context length and the KV pool."""

    context_length: int
    kv_tokens: int

    @property
    def limit(self) -> int:
        return min(self.context_length, self.kv_tokens)

    def room(self, prompt_tokens: int) -> int:
        """Output tokens left after a prompt of this length (may be zero or negative)."""
        return self.limit - prompt_tokens

    def problem(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """Why a request of this size can never run ("" when it fits)."""
        if prompt_tokens + max_new_tokens <= self.limit:
            return ""
        return (
            f"one request may hold {self.limit} tokens (context length {self.context_length}, "
            f"KV pool {self.kv_tokens}); the prompt has {prompt_tokens} tokens and "
            f"max_tokens asks for {max_new_tokens}"
        )
