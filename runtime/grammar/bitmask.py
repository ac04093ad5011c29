"""Token bitmasks for a batch: one int32 row per constrained request, one bit per token.

`fill_batch` writes the rows of the requests that have a matcher (and the CPU time each row's
fill took); `apply_bitmask` sets every forbidden logit of those rows to -inf in one vectorised
operation. A batch with no matcher gets None from `fill_batch` and `apply_bitmask` returns at
once: unconstrained batches pay nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.grammar.base import GrammarMatcher

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


@dataclass
class BatchMask:
    """`bitmask[i]` is the mask of logits row `rows[i]` (rows ascending, each once); `fill_s[i]`
    the thread CPU seconds its fill took."""

    bitmask: torch.Tensor
    rows: torch.Tensor
    fill_s: list[float] = field(default_factory=list)

    def allows_any(self, slot: int) -> bool:
        return bool(self.bitmask[slot].any())

    def allow_all(self, slot: int) -> None:
        self.bitmask[slot].fill_(-1)


def fill_batch(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> BatchMask | None:
    """Masks for the batch rows whose request has a matcher; None when none has."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask, fill_s = allocate_bitmask(len(rows), vocab_size), []
    for slot, row in enumerate(rows):
        matcher = matchers[row]
        assert matcher is not None
        start = time.thread_time()
        matcher.fill_bitmask(bitmask, slot)
        fill_s.append(time.thread_time() - start)
    return BatchMask(bitmask, torch.tensor(rows, dtype=torch.long), fill_s)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, width] int32 -> [rows, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, mask: BatchMask | None) -> None:
    """In place: forbidden tokens of the masked rows get -inf; other rows are untouched."""
    if mask is None:
        return
    forbidden = ~unpack_bitmask(mask.bitmask.to(logits.device), logits.shape[-1])
    if mask.rows.numel() == logits.shape[0]:  # every row constrained: fill in place
        logits.masked_fill_(forbidden, float("-inf"))
        return
    rows = mask.rows.to(logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
