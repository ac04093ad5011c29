"""The sampler: turns a batch of logits into tokens (the parameters: runtime/sampling_params.py).

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
from dataclasses import dataclass

import torch

from runtime.sampling_controls import SamplingState, apply_controls
from runtime.sampling_params import (
    TEMPERATURE_FLOOR,
    TOP_P_FLOOR,
    SamplingParams,
    TokenLogprobs,
)

_MASK64 = 2**64 - 1
FAILED_TOKEN = -1  # sample_safe's token for a row that could not be sampled
NON_FINITE = "non-finite logits"  # why such a row's request failed
UNSEEDED_STREAM = 0x5EED_0F_0A11  # sample_on_device's unseeded rows: a stream of their own


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
