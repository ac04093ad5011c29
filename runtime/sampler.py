"""Sampling parameters of a request and the sampler that turns a batch of logits into tokens.

How TP ranks agree on tokens (invariant 9 in docs/architecture.md): in a synchronous step only the
entry rank (rank 0) calls `Sampler.sample`; the scheduler then broadcasts the chosen token ids to
the other ranks with `broadcast_pyobj`, so the ranks cannot disagree even when their logits differ
in the last bit. An overlapped decode step (scheduler/overlap.py) has every rank draw on the same
all-gathered logits with `sample_on_device`, whose generators are seeded only from what all ranks
share (a request's seed and step; the sampler's seed and the count of such steps).
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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.grammar.base import GrammarSpec
from runtime.sampling_controls import SamplingState, apply_controls

_MASK64 = 2**64 - 1
TEMPERATURE_FLOOR = 1e-5  # below this a request is greedy
TOP_P_FLOOR = 1e-6  # float32 holds it; smaller values are raised to it
FAILED_TOKEN = -1  # sample_safe's token for a row that could not be sampled
NON_FINITE = "non-finite logits"  # why such a row's request failed
MAX_STOP_STRINGS = 16  # documented limits on stop strings (400 beyond them)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (-(2**63), 2**64)
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_BAD_WORDS = 64
MAX_N = 64
UNSEEDED_STREAM = 0x5EED_0F_0A11  # sample_on_device's unseeded rows: a stream of their own


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


# ---------------------------------------------------------------------- sampler


@dataclass
class RowControls:
    """Per row: its request's SamplingState (or None) and the stop ids min_tokens holds back."""

    states: Sequence[SamplingState | None]
    stop_ids: Sequence[Sequence[int]]

    @classmethod
    def empty(cls, rows: int) -> RowControls:
        return cls([None] * rows, [()] * rows)

    def subset(self, rows: list[int]) -> RowControls:
        return RowControls([self.states[i] for i in rows], [self.stop_ids[i] for i in rows])


@dataclass
class _Rows:
    """A batch's sampling inputs, for picking a subset of its rows."""

    logits: torch.Tensor
    params: list[SamplingParams]
    steps: list[int]
    controls: RowControls | None

    def subset(self, rows: list[int]) -> tuple[object, ...]:
        controls = None if self.controls is None else self.controls.subset(rows)
        params, steps = [self.params[i] for i in rows], [self.steps[i] for i in rows]
        return self.logits[rows], params, steps, controls


class Sampler:
    """Picks one token per row of a logits batch; rank 0's picks are broadcast by the scheduler."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        controls: RowControls | None = None,
    ) -> torch.Tensor:
        """Token ids [B] (int64, on the logits' device) for logits [B, V].

        `steps[i]` is how many tokens request i has generated so far (it seeds seeded requests
        and counts towards min_tokens); `controls` carries what the requests' penalties, bad
        words and min_tokens need (runtime/sampling_controls.py).
        """
        if not logits.shape[0] == len(params) == len(steps):
            raise ValueError(
                f"{logits.shape[0]} logit rows, {len(params)} params, {len(steps)} steps"
            )
        logits = logits.float()
        if any(p.uses_controls for p in params):
            rows = controls or RowControls.empty(len(params))
            logits = apply_controls(logits.clone(), params, steps, rows.states, rows.stop_ids)
            if not logits.isfinite().any(dim=-1).all():
                raise ValueError("the request's controls leave no token that may be sampled")
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            picked = [params[i] for i in rows], [steps[i] for i in rows]
            tokens[rows] = self._sample_rows(logits[rows], *picked)
        return tokens

    def sample_safe(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        controls: RowControls | None = None,
    ) -> tuple[list[int], dict[int, str]]:
        """Like `sample`, but a row that cannot be sampled fails alone: its token is FAILED_TOKEN
        and its index maps to the reason. Rows with NaN/+inf logits fail up front; if the batch
        still raises, each row is sampled on its own so the fault is pinned on its request."""
        if controls is None and not any(p.uses_controls for p in params):
            fast = self._sample_in_one_read(logits, params, steps)
            if fast is not None:
                return fast
        errors = {i: NON_FINITE for i in bad_rows(logits)}
        good = [i for i in range(len(params)) if i not in errors]
        tokens = [FAILED_TOKEN] * len(params)
        batch = _Rows(logits, params, steps, controls)
        try:
            picked = self._sample_subset(batch, good)
        except Exception:  # noqa: BLE001 - retried row by row to find the request at fault
            picked = []
            for i in good:
                try:
                    picked += self._sample_subset(batch, [i])
                except Exception as exc:  # noqa: BLE001 - this request's sampling fault
                    errors[i] = f"sampling failed: {exc!r}"
                    picked.append(FAILED_TOKEN)
        for i, token in zip(good, picked):
            tokens[i] = token
        return tokens, errors

    def _sample_in_one_read(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> tuple[list[int], dict[int, str]] | None:
        """`sample_safe` for rows without controls, reading the device once (the tokens and
        which rows had bad logits, together): a GPU step then waits for its results once.
        Bad rows are drawn from zeros instead (a drawing from NaN would fault the device) and
        failed after. None when the batch raised: `sample_safe` then finds the row at fault."""
        bad = bad_row_mask(logits)
        safe = logits
        if not all(p.is_greedy for p in params):
            safe = logits.masked_fill(bad[:, None], 0.0)
        try:
            tokens = self.sample(safe, params, steps)
        except Exception:  # noqa: BLE001 - retried row by row by sample_safe
            return None
        values = torch.cat((tokens, bad.long())).tolist()
        n = len(params)
        errors = {i: NON_FINITE for i in range(n) if values[n + i]}
        return [FAILED_TOKEN if i in errors else t for i, t in enumerate(values[:n])], errors

    def _sample_subset(self, batch: _Rows, rows: list[int]) -> list[int]:
        if not rows:
            return []
        return self.sample(*batch.subset(rows)).tolist()

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

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        columns: torch.Tensor,
        draw: int,
    ) -> torch.Tensor:
        """Tokens [B] on the logits' device, with no read back and no host tensor copied in:
        `sample` for requests without controls, its per-row settings taken from `columns`
        (`sampler_columns`, already on the device). Greedy rows take the argmax and seeded rows
        draw from their own generator exactly as `sample` draws them. The other sampled rows
        draw together (over every row, so which rows draw needs no index from the host) from a
        generator seeded from (this sampler's seed, `draw`): with the same logits and the same
        `draw` (the count of such steps, which every rank keeps alike), every TP rank draws the
        same tokens without rank 0's broadcast (invariant 9's seeding rule). A row with bad
        logits draws from zeros (a drawing from NaN would fault a GPU); the caller fails it."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy
        safe = logits.masked_fill(bad_row_mask(logits)[:, None], 0.0)
        probs, order = _filtered(safe, columns)
        gen = request_generator(mix_seed(self.seed, draw), UNSEEDED_STREAM, probs.device)
        picks = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy:
                gen = request_generator(p.seed, steps[i], probs.device)
                picks[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        drawn = order.gather(1, picks[:, None]).squeeze(1)
        return torch.where(columns[4] > 0, drawn, greedy)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]


@dataclass
class TokenLogprobs:
    """One output token's log-probability under the model's raw distribution (before the
    sampling controls, temperature and filters, as vLLM reports by default) and the `logprobs`
    most likely tokens, highest first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> dict[int, TokenLogprobs]:
    """Row -> logprobs of the chosen token, for the rows whose request asks for them (none:
    nothing is computed). `logits` are the model's raw logits, before any control."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] >= 0]
    if not rows:
        return {}
    logprobs = logits[rows].float().log_softmax(dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)[:, None]
    picked = logprobs.gather(1, chosen).squeeze(1).tolist()
    k = max(params[i].logprobs for i in rows)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    out = {}
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = TokenLogprobs(tokens[i], picked[j], list(zip(ids[j][:n], values[j][:n])))
    return out


def filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 probabilities after temperature, top-k, top-p and min-p, over each row's tokens
    sorted by logit (highest first, ties by token id), plus that order. Dropped tokens get 0;
    the best token is always kept. Rows are not renormalised (multinomial does not need it)."""
    columns = sampler_columns(params, logits.shape[-1]).to(logits.device)
    return _filtered(logits, columns)


def sampler_columns(params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Host float32 [5, B]: each row's temperature, top-k, top-p and min-p as `_filtered` takes
    them (floors applied, top-k within the vocabulary), and 1 where the row samples (0: greedy;
    its settings are then neutral)."""
    rows = [
        (max(p.temperature, TEMPERATURE_FLOOR), vocab if p.top_k < 0 else min(p.top_k, vocab),
         max(p.top_p, TOP_P_FLOOR), p.min_p, 1.0)
        if not p.is_greedy
        else (1.0, vocab, 1.0, 0.0, 0.0)
        for p in params
    ]  # fmt: skip
    return torch.tensor(rows, dtype=torch.float32).T.contiguous()


def _filtered(logits: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`filtered_probs` with the rows' settings as `sampler_columns`, on the logits' device."""
    temps, top_k, top_p, min_p, _ = columns[:, :, None].unbind(0)
    ranked, order = (logits.float() / temps).sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(ranked.shape[-1], device=ranked.device)
    probs = ranked.masked_fill(positions >= top_k, -math.inf).softmax(dim=-1)
    return _min_p(_top_p(probs, top_p), min_p), order


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest head of the ranking whose mass reaches top_p (top_p 1 keeps all)."""
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1)
    drop[:, 0] = False  # the best token stays, whatever rounding did to the mass
    return probs.masked_fill(drop, 0.0)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the best token (column 0 of the ranking)."""
    return probs.masked_fill(probs < min_p * probs[:, :1], 0.0)


def bad_row_mask(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool, on the logits' device: rows with a NaN or +inf logit, or no finite logit.

    One pass: a row's maximum is NaN when the row holds a NaN (amax propagates it), +inf when
    it holds +inf, -inf when nothing in it is finite, and finite otherwise. (Three reductions
    over the row took 55x as long on a CPU at a 152k vocabulary: 26 ms for 16 rows.)"""
    return ~torch.isfinite(logits.amax(dim=-1))


def bad_rows(logits: torch.Tensor) -> list[int]:
    """Rows with a NaN or +inf logit, or no finite logit at all."""
    return bad_row_mask(logits).nonzero().flatten().tolist()


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
