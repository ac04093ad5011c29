"""Sampling parameters of a request and the sampler that turns a batch of logits into tokens.

How TP ranks agree on tokens (invariant 9 in docs/architecture.md): only the entry rank (rank 0)
calls `Sampler.sample`; the scheduler then broadcasts the chosen token ids to the other ranks with
`broadcast_pyobj`, so the ranks cannot disagree even when their logits differ in the last bit.
Sampling is also deterministic on its own: with identical logits, params and steps, samplers
built with the same `Sampler(seed=...)` draw identical tokens, on any rank.

Numerical safety: a temperature below TEMPERATURE_FLOOR is greedy (dividing by a float32 zero
would give inf/NaN), a top-p below TOP_P_FLOOR is raised to it and the best token is always kept,
and a logits row with NaN or +inf (or nothing finite) fails that request alone: `sample_safe`
returns FAILED_TOKEN for it with a reason, and samples the other rows as usual.

Seeds: a request that carries a seed draws decode step t from a fresh generator seeded from
(seed, t), so its tokens depend only on its own logits, seed and step: not on which requests
share the batch or which row it occupies. Requests without a seed share the sampler's generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

_MASK64 = 2**64 - 1
TEMPERATURE_FLOOR = 1e-5  # below this a request is greedy
TOP_P_FLOOR = 1e-6  # float32 holds it; smaller values are raised to it
FAILED_TOKEN = -1  # sample_safe's token for a row that could not be sampled
MAX_STOP_STRINGS = 16  # documented limits on stop strings (400 beyond them)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (-(2**63), 2**64)


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    def normalize(self) -> SamplingParams:
        """Coerce types and check ranges in place; raise ValueError naming the bad field."""
        self.temperature = _number("temperature", self.temperature)
        self.top_p = _number("top_p", self.top_p)
        self.min_p = _number("min_p", self.min_p)
        self.top_k = _integer("top_k", self.top_k)
        self.max_new_tokens = _integer("max_new_tokens", self.max_new_tokens)
        self.seed = None if self.seed is None else _integer("seed", self.seed)
        self.stop = _strings(self.stop or [])
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids or []]
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        for message in range_errors(self):
            raise ValueError(message)
        return self


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
    ]
    return [message for ok, message in checks if not ok]


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


def _strings(stop: object) -> list[str]:
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return list(values)


# ---------------------------------------------------------------------- sampler


class Sampler:
    """Picks one token per row of a logits batch; rank 0's picks are broadcast by the scheduler."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """Token ids [B] (int64, on the logits' device) for logits [B, V].

        `steps[i]` is how many tokens request i has generated so far (it seeds seeded requests).
        """
        if not logits.shape[0] == len(params) == len(steps):
            raise ValueError(
                f"{logits.shape[0]} logit rows, {len(params)} params, {len(steps)} steps"
            )
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            picked = [params[i] for i in rows], [steps[i] for i in rows]
            tokens[rows] = self._sample_rows(logits[rows], *picked)
        return tokens

    def sample_safe(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> tuple[list[int], dict[int, str]]:
        """Like `sample`, but a row that cannot be sampled fails alone: its token is FAILED_TOKEN
        and its index maps to the reason. Rows with NaN/+inf logits fail up front; if the batch
        still raises, each row is sampled on its own so the fault is pinned on its request."""
        errors = {i: "non-finite logits" for i in bad_rows(logits)}
        good = [i for i in range(len(params)) if i not in errors]
        tokens = [FAILED_TOKEN] * len(params)
        try:
            picked = self._sample_subset(logits, params, steps, good)
        except Exception:  # noqa: BLE001 - retried row by row to find the request at fault
            picked = []
            for i in good:
                try:
                    picked += self._sample_subset(logits, params, steps, [i])
                except Exception as exc:  # noqa: BLE001 - this request's sampling fault
                    errors[i] = f"sampling failed: {exc!r}"
                    picked.append(FAILED_TOKEN)
        for i, token in zip(good, picked):
            tokens[i] = token
        return tokens, errors

    def _sample_subset(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int], rows: list[int]
    ) -> list[int]:
        if not rows:
            return []
        sub = [params[i] for i in rows], [steps[i] for i in rows]
        return self.sample(logits[rows], *sub).tolist()

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        probs, order = filtered_probs(logits, params)
        picks = self._draw(probs, params, steps)
        return order.gather(1, picks[:, None]).squeeze(1)

    def _draw(
        self, probs: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        """One index per row: seeded rows each from their own generator, the rest together."""
        picks = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            gen = self._shared_generator(probs.device)
            picks[shared] = torch.multinomial(probs[shared], 1, generator=gen).squeeze(1)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = request_generator(p.seed, steps[i], probs.device)
                picks[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return picks

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]


def filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 probabilities after temperature, top-k, top-p and min-p, over each row's tokens
    sorted by logit (highest first, ties by token id), plus that order. Dropped tokens get 0;
    the best token is always kept. Rows are not renormalised (multinomial does not need it)."""
    temps = _column([max(p.temperature, TEMPERATURE_FLOOR) for p in params], logits.device)
    ranked, order = (logits.float() / temps).sort(dim=-1, descending=True, stable=True)
    probs = _top_k(ranked, [p.top_k for p in params]).softmax(dim=-1)
    probs = _top_p(probs, _column([max(p.top_p, TOP_P_FLOOR) for p in params], logits.device))
    probs = _min_p(probs, _column([p.min_p for p in params], logits.device))
    return probs, order


def _top_k(ranked: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = ranked.shape[-1]
    ks = _column([vocab if k < 0 else min(k, vocab) for k in top_k], ranked.device)
    positions = torch.arange(vocab, device=ranked.device)
    return ranked.masked_fill(positions >= ks, -math.inf)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest head of the ranking whose mass reaches top_p (top_p 1 keeps all)."""
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1)
    drop[:, 0] = False  # the best token stays, whatever rounding did to the mass
    return probs.masked_fill(drop, 0.0)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the best token (column 0 of the ranking)."""
    return probs.masked_fill(probs < min_p * probs[:, :1], 0.0)


def bad_rows(logits: torch.Tensor) -> list[int]:
    """Rows with a NaN or +inf logit, or no finite logit at all."""
    bad = logits.isnan().any(dim=-1) | (logits == math.inf).any(dim=-1)
    bad |= ~logits.isfinite().any(dim=-1)
    return bad.nonzero().flatten().tolist()


def _column(values: list[float] | list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def request_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator for one seeded request at one step: the same on every call and rank."""
    return torch.Generator(device=device).manual_seed(mix_seed(seed, step))


def mix_seed(seed: int, step: int) -> int:
    """Spread (seed, step) over 63 bits with the splitmix64 finaliser, so that nearby seeds and
    steps give unrelated generator states."""
    x = (seed * 0x9E3779B97F4A7C15 + step) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
