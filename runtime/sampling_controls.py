"""Logits controls over a batch: allowed_token_ids, bad_words, min_tokens, logit_bias and the
repetition, frequency and presence penalties.

Order (vLLM's): allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties, all on
the model's raw logits and before temperature and the filters (runtime/sampler.py). Logprobs are
taken before any of this: they report the raw model distribution.

Definitions: repetition_penalty is HF's and vLLM's (a logit of a token seen in the prompt or the
output is divided by it when positive, multiplied when negative); presence and frequency
penalties are OpenAI's (over output tokens only: logit -= frequency * count + presence).
min_tokens masks the request's stop token ids (EOS unless ignore_eos, and stop_token_ids) while
its output is shorter. A bad word's last token is banned when the output ends with the rest of
the word (vLLM's rule: output tokens only).

State (invariant 17): a request that uses a penalty, bad words or allowed_token_ids carries a
`SamplingState` (allowed_token_ids as an index tensor, built once) that the scheduler advances
with each token it accepts, so a step never recounts a request's tokens.
Retraction keeps a request's tokens (only their KV is recomputed), so its state stays valid; a
request rebuilt from its tokens gets its state rebuilt by `SamplingState.for_request`.

Cost: rows that use no control cost nothing, and a batch where none does returns at once. The
work of a step is proportional to the distinct tokens the controlled rows have seen, never to
batch x vocabulary, except for allowed_token_ids (one mask row per request that uses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class SamplingState:
    """What one request's controls need from its tokens, advanced with each accepted token."""

    prompt_seen: list[int]  # distinct in-vocabulary prompt ids (repetition penalty only)
    prompt_set: frozenset[int]
    keep_recent: int  # output tokens the longest bad word needs
    output_seen: list[int] = field(default_factory=list)  # distinct output ids not in the prompt
    counts: dict[int, int] = field(default_factory=dict)  # output id -> times generated
    recent: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # allowed_token_ids as an index, built once

    @classmethod
    def for_request(
        cls,
        params: SamplingParams,
        token_ids: Sequence[int],
        prompt_len: int,
        vocab_size: int,
        placeholders: dict[int, int] | None = None,
    ) -> SamplingState | None:
        """The state of a request with these tokens, or None when its controls need none.
        `placeholders`: pad value -> the placeholder token id its media item stands for (so the
        repetition penalty sees the prompt as HF and vLLM do, image tokens included)."""
        allowed = params.allowed_token_ids
        if not (params.uses_penalties or params.bad_words_ids or allowed is not None):
            return None
        seen: list[int] = []
        if params.repetition_penalty != 1.0:
            swap = placeholders or {}
            prompt = {swap.get(t, t) for t in token_ids[:prompt_len]}
            seen = sorted(t for t in prompt if 0 <= t < vocab_size)
        keep = max((len(w) - 1 for w in params.bad_words_ids), default=0)
        state = cls(seen, frozenset(seen), keep)
        if allowed is not None:
            state.allowed = torch.tensor(sorted(set(allowed)), dtype=torch.int64)
        for token in token_ids[prompt_len:]:
            state.accept(token)
        return state

    def accept(self, token: int) -> None:
        if token not in self.counts and token not in self.prompt_set:
            self.output_seen.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.keep_recent:
            self.recent.append(token)
            del self.recent[: -self.keep_recent]

    def banned_by_words(self, words: list[list[int]]) -> list[int]:
        """Last tokens of the bad words whose other tokens end the output."""
        recent = self.recent
        return [w[-1] for w in words if len(w) == 1 or recent[len(recent) - len(w) + 1 :] == w[:-1]]


@dataclass
class _Edits:
    """The step's sparse edits, as flat (row, token, value) lists."""

    ban_rows: list[int] = field(default_factory=list)
    ban_ids: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    bias: list[float] = field(default_factory=list)
    rep_rows: list[int] = field(default_factory=list)
    rep_ids: list[int] = field(default_factory=list)
    rep: list[float] = field(default_factory=list)
    pen_rows: list[int] = field(default_factory=list)
    pen_ids: list[int] = field(default_factory=list)
    pen: list[float] = field(default_factory=list)

    def ban(self, row: int, ids: Sequence[int]) -> None:
        self.ban_rows += [row] * len(ids)
        self.ban_ids += ids

    def add(self, row: int, ids: Sequence[int], values: Sequence[float]) -> None:
        self.bias_rows += [row] * len(ids)
        self.bias_ids += ids
        self.bias += values

    def penalise(self, row: int, ids: Sequence[int], values: Sequence[float]) -> None:
        self.pen_rows += [row] * len(ids)
        self.pen_ids += ids
        self.pen += values

    def repeat(self, row: int, ids: Sequence[int], penalty: float) -> None:
        self.rep_rows += [row] * len(ids)
        self.rep_ids += ids
        self.rep += [penalty] * len(ids)


def apply_controls(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    states: Sequence[SamplingState | None] | None,
    stop_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The batch's logits [B, V] (float32) with every row's controls applied (in place when any
    applies). `steps[i]`: output tokens so far; `stop_ids[i]`: what min_tokens holds back."""
    rows = [i for i, p in enumerate(params) if p.uses_controls]
    if not rows:
        return logits
    allowed = [i for i in rows if params[i].allowed_token_ids is not None]
    if allowed:
        _restrict_to_allowed(logits, allowed, params, states)
    edits = _Edits()
    for i in rows:
        state = states[i] if states is not None else None
        _row_edits(edits, i, params[i], steps[i], state, stop_ids[i] if stop_ids else ())
    _apply_edits(logits, edits)
    return logits


def _row_edits(
    edits: _Edits,
    row: int,
    p: SamplingParams,
    step: int,
    state: SamplingState | None,
    stop_ids: Sequence[int],
) -> None:
    if p.bad_words_ids and state is not None:
        edits.ban(row, state.banned_by_words(p.bad_words_ids))
    if step < p.min_tokens:
        edits.ban(row, [*stop_ids, *p.stop_token_ids])
    if p.logit_bias:
        edits.add(row, list(p.logit_bias), list(p.logit_bias.values()))
    if state is None:
        return
    if p.repetition_penalty != 1.0:
        edits.repeat(row, [*state.prompt_seen, *state.output_seen], p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        counts = state.counts
        penalties = [-(p.frequency_penalty * c + p.presence_penalty) for c in counts.values()]
        edits.penalise(row, list(counts), penalties)


def _restrict_to_allowed(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    states: Sequence[SamplingState | None] | None,
) -> None:
    """Every other token of these rows to -inf (their index built once, in their state)."""
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for k, row in enumerate(rows):
        state = states[row] if states is not None else None
        ids = state.allowed if state is not None and state.allowed is not None else None
        if ids is None:
            ids = torch.tensor(params[row].allowed_token_ids, dtype=torch.int64)
        keep[k, ids.to(logits.device)] = True
    logits[rows] = logits[rows].masked_fill(~keep, -math.inf)


def _apply_edits(logits: torch.Tensor, e: _Edits) -> None:
    if e.ban_ids:
        logits[_index(e.ban_rows, logits), _index(e.ban_ids, logits)] = -math.inf
    _add(logits, e.bias_rows, e.bias_ids, e.bias)
    if e.rep_ids:
        _repetition(logits, e)
    _add(logits, e.pen_rows, e.pen_ids, e.pen)


def _add(logits: torch.Tensor, rows: list[int], ids: list[int], values: list[float]) -> None:
    if ids:
        where = (_index(rows, logits), _index(ids, logits))
        added = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(where, added, accumulate=True)


def _repetition(logits: torch.Tensor, e: _Edits) -> None:
    """Each (row, token) appears once: the prompt and output lists of a state are disjoint."""
    where = (_index(e.rep_rows, logits), _index(e.rep_ids, logits))
    penalty = torch.tensor(e.rep, dtype=logits.dtype, device=logits.device)
    values = logits[where]
    logits[where] = torch.where(values < 0, values * penalty, values / penalty)


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)
