"""The grammar engine's small interface: what a request asks for, and what the scheduler drives.

A `GrammarSpec` is a request's constraint as text (its cache key). A `GrammarBackend` compiles a
spec into an opaque compiled grammar and makes one `GrammarMatcher` per request (per choice when
n > 1) from it. The matcher moves only with accepted tokens (invariant 17): `accept_token` after
sampling, `rollback(k)` when tokens are taken back, `fill_bitmask` for the next step's mask and
`jump_forward` for what the grammar forces next. Nothing here imports a grammar library: each
engine lives in its own module, imported only when chosen.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "ebnf",
    "structural_tag",
)


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the client's fault, a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarFault:
    """A constraint that ends its request mid-decode (no token satisfies it, or the engine gave
    up at one of its limits): the client's fault, a 400 naming `param`, its request's alone."""

    detail: str
    param: str | None = None


@dataclass(frozen=True)
class ThinkSection:
    """The thinking section a reasoning model writes before the constrained part of its reply
    (`--reasoning-parser`): `end_id` is `</think>`; with `start_id` (the qwen3 rule) the reply
    thinks only if its first token is `<think>`, else (deepseek_r1) it thinks from its start."""

    end_id: int
    start_id: int | None = None


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. `text` is canonical (JSON for schemas and choices), so equal
    constraints share one compiled grammar; `param` names the request field it came from;
    `think` (not part of the key) makes the constraint start after a thinking section;
    `prepared` (not part of the key) is the engine's own form of `text` when making it costs
    time (GBNF converted to the engine's grammar): made once, by the front end's grammar worker,
    so the scheduler compiles without that work (`GrammarBackend.prepare`)."""

    kind: GrammarKind
    text: str
    param: str | None = field(default=None, compare=False)
    think: ThinkSection | None = field(default=None, compare=False)
    prepared: str | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    @property
    def text_json(self) -> dict:
        """`text` parsed (schemas and structural tags are JSON objects)."""
        return json.loads(self.text)

    @staticmethod
    def json_schema(schema: dict | str, param: str | None = None) -> GrammarSpec:
        return GrammarSpec("json_schema", canonical_json(schema, param), param)

    @staticmethod
    def structural_tag(tag: dict | str, param: str | None = None) -> GrammarSpec:
        return GrammarSpec("structural_tag", canonical_json(tag, param), param)

    @staticmethod
    def choice(choices: list[str], param: str | None = None) -> GrammarSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a non-empty list of strings", param)
        return GrammarSpec("choice", json.dumps(choices, ensure_ascii=False), param)


def canonical_json(value: dict | str, param: str | None) -> str:
    """A schema as compact JSON with sorted keys; a string that is not a JSON object is refused."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarError(f"schema is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise GrammarError("schema must be a JSON object", param)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class JumpForward:
    """What the grammar forces next: `tokens` can be appended without sampling; `text` is the
    forced string (it may go past the tokens when its tokenization is not yet fixed)."""

    tokens: list[int]
    text: str


class GrammarMatcher(ABC):
    """Per-request grammar state. Methods never raise for a bad token: it is refused (False)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens exactly."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, one bit per token)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token ended the grammar (or it can accept nothing more)."""

    @abstractmethod
    def jump_forward(self) -> JumpForward:
        """The tokens and text the grammar forces next (empty when the next step is a choice)."""

    @property
    @abstractmethod
    def num_accepted(self) -> int:
        """Tokens accepted and not rolled back: how far `rollback` can go."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the engine gave up on this request (a limit hit mid-generation), else None: the
        scheduler then ends the request with an error instead of unconstrained output."""


class GrammarBackend(ABC):
    """One grammar engine bound to one tokenizer and vocabulary."""

    name: str
    vocab_size: int

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> object:
        """Compile `spec` (blocking; callers run it off their loop). Raises GrammarError."""

    @abstractmethod
    def new_matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def prepare(self, spec: GrammarSpec) -> GrammarSpec:
        """`spec` with `prepared` set where this engine's form of it costs time to make (it
        compiles the same); as it is otherwise. Raises GrammarError."""
        return spec
