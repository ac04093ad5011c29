"""The llguidance engine behind the grammar interface (imported only when chosen).

A compiled grammar is a template `LLMatcher` that never advances; each request's matcher is a
deep copy of it (cheap: the lexer and token trie are shared). llguidance never raises for a
grammar error: the matcher enters an error state, which compile turns into a GrammarError, as
it does the ValueErrors the engine raises while reading a grammar (JSON nested past its parser's
recursion limit, a GBNF grammar its converter cannot read).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import llguidance
import torch

from runtime.grammar.base import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    JumpForward,
)


@dataclass(frozen=True)
class EngineLimits:
    """Bounds on one grammar's size and on the work one compile or one mask may take.

    `step_max_items` bounds one mask fill's Earley items. An item's cost grows with the rows
    an ambiguous grammar builds, so the bound is far below the engine's own (50,000): at 2,000
    an ambiguous grammar's worst fill measured ~25 ms (at 50,000: ~600 ms, for 160 tokens),
    while the JSON schemas, tool grammars, regexes and choices tested need well under it, on
    a 151k-token vocabulary too. A matcher past a limit is in an error state (`error()`)."""

    max_grammar_size: int = 200_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 2_000
    max_lexer_states: int = 100_000

    def to_llguidance(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            verbose_errors=False,
        )


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher
        self._accepted = 0

    def accept_token(self, token: int) -> bool:
        if self._m.validate_tokens([token]) != 1 or not self._m.consume_token(token):
            return False
        self._accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._accepted} tokens")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._m.get_error()}")
        self._accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if bitmask.dtype != torch.int32 or not target.is_contiguous() or target.is_cuda:
            raise ValueError("a bitmask row must be contiguous int32 in host memory")
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def jump_forward(self) -> JumpForward:
        if self._m.is_stopped():
            return JumpForward([], "")
        forced = self._m.compute_ff_bytes()
        return JumpForward(self._m.compute_ff_tokens(), complete_utf8(forced))

    @property
    def num_accepted(self) -> int:
        return self._accepted

    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return short_message(self._m.get_error().replace("<non-verbose/>", ""))


def complete_utf8(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, as text."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class LLGuidanceBackend(GrammarBackend):
    """llguidance over a Hugging Face fast tokenizer's `tokenizer.json` text.

    `stop_token_ids` end the grammar (Qwen: `<|im_end|>`, `<|endoftext|>`); `vocab_size` is the
    model's logits width (it may exceed the tokenizer's). JSON is compact unless `any_whitespace`.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        stop_token_ids: list[int],
        limits: EngineLimits = EngineLimits(),
        any_whitespace: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self._limits = limits
        self._json_options = {"whitespace_flexible": any_whitespace, "lenient": False}

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            grammar = self._grammar_text(spec)
            matcher = llguidance.LLMatcher(
                self._tok, grammar, log_level=0, limits=self._limits.to_llguidance()
            )
        except GrammarError:
            raise
        except ValueError as exc:  # the engine's own refusals: "recursion limit exceeded", ...
            message = short_message(str(exc))
            raise GrammarError(f"invalid {spec.kind}: {message}", spec.param) from None
        matcher.compute_bitmask()  # builds the first lexer states: a limit hit now is a 400
        if matcher.is_error():
            message = short_message(matcher.get_error())
            raise GrammarError(f"invalid {spec.kind}: {message}", spec.param)
        return matcher

    def new_matcher(self, compiled: object) -> GrammarMatcher:
        assert isinstance(compiled, llguidance.LLMatcher)
        return LLGuidanceMatcher(compiled.deep_copy())

    def prepare(self, spec: GrammarSpec) -> GrammarSpec:
        """GBNF is converted to the engine's grammar by Python code whose time grows with the
        square of a rule chain (seconds at 2,000 rules, holding the GIL): converted once."""
        if spec.kind != "ebnf" or spec.prepared is not None:
            return spec
        return dataclasses.replace(spec, prepared=ebnf_grammar(spec))

    def _grammar_text(self, spec: GrammarSpec) -> str:
        if spec.prepared is not None:
            return spec.prepared
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, self._json_options)
        if spec.kind == "json_object":
            schema = '{"type":"object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, self._json_options)
        if spec.kind in ("regex", "choice"):
            return llguidance.grammar_from(spec.kind, spec.text)
        if spec.kind == "ebnf":
            return ebnf_grammar(spec)
        if spec.kind == "structural_tag":
            return structural_tag_grammar(spec)
        raise GrammarError(f"{spec.kind} is not supported by the llguidance backend", spec.param)


def ebnf_grammar(spec: GrammarSpec) -> str:
    """GBNF (`root ::= ...`, as xgrammar and llama.cpp write it) or Lark, to llguidance's form."""
    try:
        return llguidance.grammar_from("grammar", spec.text)
    except ValueError as exc:
        raise GrammarError(f"invalid ebnf: {short_message(str(exc))}", spec.param) from None


def structural_tag_grammar(spec: GrammarSpec) -> str:
    """Free text in which each trigger starts a tagged segment: `begin`, JSON by `schema`, `end`.

    The spec is `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`; each begin
    must start with one of the triggers (the longest is taken)."""
    try:
        tags = [struct_tag(s, spec.text_json["triggers"]) for s in spec.text_json["structures"]]
        if not tags:
            raise ValueError("structures must not be empty")
        grammar = llguidance.StructTag.to_grammar(tags, assume_special=False)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise GrammarError(f"invalid structural_tag: {exc!s:.200}", spec.param) from None
    return grammar if grammar.startswith("{") else llguidance.LLMatcher.grammar_from_lark(grammar)


def struct_tag(structure: dict, triggers: list[str]) -> llguidance.StructTag:
    begin = structure["begin"]
    matching = [t for t in triggers if isinstance(t, str) and t and begin.startswith(t)]
    if not matching:
        raise ValueError(f"begin {begin!r} starts with none of the triggers")
    schema = json.dumps(structure["schema"], separators=(",", ":"))
    return llguidance.StructTag(
        trigger=max(matching, key=len), begin=begin, grammar=schema, end=structure["end"]
    )


def short_message(message: str, limit: int = 300) -> str:
    """An engine error as one line a client can read (the engine's may span a source excerpt)."""
    text = " ".join(message.split())
    return (text[:limit] + "...") if len(text) > limit else (text or "rejected by the engine")
