"""Structured outputs: constraints compiled off the loop, per-request matchers, batch bitmasks.

Floor 2: imports nothing from scheduler/ or tokenizer_manager/. `make_backend` picks the engine
(llguidance by default; the engine's module is imported only here, when chosen).
"""

from __future__ import annotations

from runtime.grammar.base import (
    KINDS,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    JumpForward,
)
from runtime.grammar.bitmask import BatchMask, apply_bitmask, fill_batch
from runtime.grammar.compiler import CompileLimits, GrammarCompiler
from runtime.grammar.reasoning import ReasoningMatcher

__all__ = [
    "KINDS",
    "BatchMask",
    "CompileLimits",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "JumpForward",
    "ReasoningMatcher",
    "apply_bitmask",
    "fill_batch",
    "make_backend",
]


def make_backend(
    engine: str, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]
) -> GrammarBackend:
    """The grammar backend named `engine` for one tokenizer (its `tokenizer.json` text)."""
    if engine == "llguidance":
        from runtime.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer_json, vocab_size, stop_token_ids)
    raise ValueError(f"unknown grammar engine {engine!r} (available: llguidance)")
