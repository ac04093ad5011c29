"""A request's sampling parameters: the `SamplingParams` dataclass, its coercions and range
checks (each failure a ValueError naming the field, which the front end answers with a 400), the
documented limits, and what sampling reports back per token (`TokenLogprobs`).

Pure data and checks: the front end and the IPC messages (runtime/io_struct.py) import this
module, never the torch sampler (runtime/sampler.py) that consumes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from runtime.grammar.base import GrammarSpec

TEMPERATURE_FLOOR = 1e-5  # below this a request is greedy
TOP_P_FLOOR = 1e-6  # float32 holds it; smaller values are raised to it
MAX_STOP_STRINGS = 16  # documented limits on stop strings (400 beyond them)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (-(2**63), 2**64)
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_BAD_WORDS = 64
MAX_N = 64


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    top_k = -1 turns top-k off; temperature 0 (or top_k 1) is greedy. `stop` strings are matched
    and trimmed by the detokenizer; `stop_token_ids` end the request in the scheduler.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI: over output tokens
    frequency_penalty: float = 0.0  # OpenAI: over output tokens, times their count
    min_tokens: int = 0  # no stop token or stop string before this many output tokens
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # from bad_words, at admission
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's and k alternatives
    include_stop_str_in_output: bool = False
    n: int = 1  # choices forked from one prefill
    grammar: GrammarSpec | None = None  # structured output: the constraint (runtime/grammar/)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def uses_controls(self) -> bool:
        """Any logits control besides temperature and the filters (the sampler skips the rest
        of the batch's controls when no row uses one)."""
        return bool(
            self.uses_penalties
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_ids
        )

    def normalize(self) -> SamplingParams:
        """Coerce types and check ranges in place; raise ValueError naming the bad field."""
        for names, coerce in _COERCIONS:
            for name in names:
                setattr(self, name, coerce(name, getattr(self, name)))
        self.stop = _strings(self.stop or [])
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids or []]
        self.logit_bias = _bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = _list("allowed_token_ids", self.allowed_token_ids)
            self.allowed_token_ids = [_integer("allowed_token_ids", t) for t in ids]
        self.bad_words = _strings(self.bad_words or [], "bad_words")
        for message in range_errors(self):
            raise ValueError(message)
        return self

    def token_ids_named(self) -> dict[str, list[int]]:
        """Token ids the request names, by field (checked against the vocabulary by the
        scheduler)."""
        return {
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": list(self.allowed_token_ids or []),
        }


def range_errors(p: SamplingParams) -> list[str]:
    """Messages for every out-of-range field (empty when the params are valid)."""
    checks = [
        (0 <= p.temperature <= 2, f"temperature must be in [0, 2], got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {p.top_k}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {p.max_new_tokens}"),
        (
            p.seed is None or SEED_RANGE[0] <= p.seed < SEED_RANGE[1],
            f"seed must fit in 64 bits, got {p.seed}",
        ),
        (
            len(p.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in p.stop),
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each",
        ),
        (
            len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
        ),
        *control_checks(p),
    ]
    return [message for ok, message in checks if not ok]


def control_checks(p: SamplingParams) -> list[tuple[bool, str]]:
    bias = p.logit_bias or {}
    return [
        (
            0 < p.repetition_penalty <= 2,
            f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}",
        ),
        (
            -2 <= p.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {p.presence_penalty}",
        ),
        (
            -2 <= p.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}",
        ),
        (
            0 <= p.min_tokens <= p.max_new_tokens,
            f"min_tokens must be in [0, max_new_tokens={p.max_new_tokens}], got {p.min_tokens}",
        ),
        (
            len(bias) <= MAX_LOGIT_BIAS and all(-100 <= b <= 100 for b in bias.values()),
            f"logit_bias takes at most {MAX_LOGIT_BIAS} entries with values in [-100, 100]",
        ),
        (
            p.allowed_token_ids is None or len(p.allowed_token_ids) > 0,
            "allowed_token_ids must not be empty",
        ),
        (
            len(p.bad_words) <= MAX_BAD_WORDS
            and all(0 < len(w) <= MAX_STOP_CHARS for w in p.bad_words),
            f"bad_words takes at most {MAX_BAD_WORDS} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters each",
        ),
        (
            p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}",
        ),
        (1 <= p.n <= MAX_N, f"n must be in [1, {MAX_N}], got {p.n}"),
    ]


def _bias(bias: object) -> dict[int, float] | None:
    """logit_bias as {token id: bias}; JSON object keys arrive as strings of digits."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        out[_integer("logit_bias", token)] = _number("logit_bias", value)
    return out


def _list(name: str, value: object) -> list[object]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _integer(name: str, value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _strings(stop: object, name: str = "stop") -> list[str]:
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
        raise ValueError(f"{name} must be a string or a list of strings, got {stop!r}")
    return list(values)


def _optional_integer(name: str, value: object) -> int | None:
    return None if value is None else _integer(name, value)


_COERCIONS = (
    (
        (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ),
        _number,
    ),
    (("top_k", "max_new_tokens", "min_tokens", "n"), _integer),
    (("seed", "logprobs"), _optional_integer),
    (
        ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"),
        _flag,
    ),
)


@dataclass
class TokenLogprobs:
    """One output token's log-probability under the model's raw distribution (before the
    sampling controls, temperature and filters, as vLLM reports by default) and the `logprobs`
    most likely tokens, highest first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class TokenEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(tokenizer: TokenEncoder, words: Sequence[str]) -> list[list[int]]:
    """Each bad word as token ids, once as written and once after a space when that spelling is
    as many tokens long with another first token (how a word reads mid-sentence)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [plain] if plain else []
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return sequences
