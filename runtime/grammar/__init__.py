"""Structured outputs: constraints compiled off the loop, per-request matchers, batch bitmasks.

Floor 2: imports nothing from scheduler/ or tokenizer_manager/. `make_backend` picks the engine
(llguidance by default; the engine's module is imported only here, when chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.grammar.base import (
    KINDS,
    GrammarBackend,
    GrammarError,
    GrammarFault,
    GrammarMatcher,
    GrammarSpec,
    JumpForward,
    ThinkSection,
)
from runtime.grammar.bitmask import BatchMask, apply_bitmask, fill_batch
from runtime.grammar.compiler import CompileLimits, GrammarCompiler, check_limits
from runtime.grammar.limits import StructureLimits
from runtime.grammar.reasoning import ReasoningMatcher

__all__ = [
    "KINDS",
    "BatchMask",
    "CheckpointGrammar",
    "CompileLimits",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarFault",
    "GrammarMatcher",
    "GrammarSpec",
    "JumpForward",
    "ReasoningMatcher",
    "StructureLimits",
    "ThinkSection",
    "apply_bitmask",
    "check_limits",
    "checkpoint_compiler",
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


@dataclass(frozen=True)
class CheckpointGrammar:
    """What a checkpoint's grammar backend is built from (small and picklable: the front end
    sends it to its compile workers)."""

    model_path: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    engine: str = "llguidance"

    def backend(self) -> GrammarBackend:
        """The backend over the checkpoint's `tokenizer.json`."""
        tokenizer_json = (Path(self.model_path) / "tokenizer.json").read_text(encoding="utf-8")
        return make_backend(self.engine, tokenizer_json, self.vocab_size, list(self.stop_token_ids))


def checkpoint_compiler(
    model_path: str, vocab_size: int, stop_token_ids: list[int], engine: str = "llguidance"
) -> GrammarCompiler:
    """A compiler for the checkpoint at `model_path` (its `tokenizer.json`), with the default
    limits: what the entry rank compiles with."""
    source = CheckpointGrammar(model_path, vocab_size, tuple(stop_token_ids), engine)
    return GrammarCompiler(source.backend())
