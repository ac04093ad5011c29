"""Overlapped decode: the next decode step is launched before the last one's tokens are read.

On a GPU, a decode step's host work (building and staging its inputs, reading its tokens back,
appending them, finishing requests, reporting outputs) otherwise leaves the device idle once per
step. With overlap, the next step's input ids are the last step's sampled tokens as they sit on
the device (each row gathers its own by index), so the host launches step N+1 first, then waits
for step N's tokens and does step N's bookkeeping while the device computes N+1.

Which steps overlap (`OverlapDecoder.can_run`): decode steps over the static decode buffers
(runtime/decode_graphs.py) whose requests have no grammar, logprobs, sampling controls or
jump-forward run, greedy or sampled. A sampled row is drawn on the device
(`Sampler.sample_on_device`) from per-row settings staged in one copy (`sampler_columns`).
Anything else (a prefill, any message, a request that is not eligible, too few free KV slots)
first resolves the step in flight and runs as before, so every other path keeps its
synchronous contract. The requests of a step are checked before it is launched, as before a
synchronous one (`Scheduler.isolate`: input checks, a test's injected faults, the ranks'
agreement); a request failed there while its previous step is in flight has that step's token
dropped when it is read.

Tensor parallelism: every rank holds the same gathered logits (the LM head all-gathers them),
so in these steps each rank picks the tokens itself instead of rank 0 broadcasting its picks
through the host (invariant 9: identical inputs, a deterministic pick): the argmax, or a draw
whose generator is seeded from what every rank shares (a seeded request's seed and step; else
the sampler's seed and the count of sampled launches, `OverlapDecoder.draws`). Which steps
overlap depends only on state every rank shares (the same messages, requests and pools).

A request with a step in flight: its newest sampled token is not yet in `token_ids`, and
`kv_len` already counts the slot that step writes (`extend_len` is 0). When the step is read, a
request whose token ended it (EOS or a stop token) may already have had its next step launched:
that step's token is dropped, and the slot it wrote holds the K/V of the request's last token, so
`token_ids` and `kv_len` agree and the radix cache keeps that slot like any other. A request
whose next token is known to be its last (max_new_tokens) is left out of the next launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.forward_batch import HostStager
from runtime.sampler import Sampler, bad_row_mask, sampler_columns
from scheduler.model_runner import ModelRunner
from scheduler.req import Req


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not read yet."""

    reqs: list[Req]  # its rows, in order
    tokens: torch.Tensor  # [rows] int64 on the device: the next step's input ids
    host: torch.Tensor  # [2 * rows] int64: the tokens, then bad-row flags, copied back
    copied: torch.cuda.Event | None  # recorded after that copy (None: already on the host)

    def read(self) -> tuple[list[int], list[bool]]:
        """(tokens, whether each row's logits were bad): waits for the step on a GPU."""
        if self.copied is not None:
            self.copied.synchronize()
        values, n = self.host.tolist(), len(self.reqs)
        return values[:n], [bool(v) for v in values[n:]]


class OverlapDecoder:
    """Launches greedy decode steps without reading their tokens (see the module docstring)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        """With `sampler`, sampled requests overlap too."""
        self.runner, self.sampler = runner, sampler
        self.columns = HostStager(runner.device)  # the sampler's per-row settings, one copy
        self.draws = 0  # sampled launches so far: the same count on every rank

    def can_run(self, reqs: list[Req]) -> bool:
        graphs = self.runner.graphs
        sampled = self.sampler is not None
        return (
            bool(reqs)
            and graphs is not None
            and graphs.fits(len(reqs))
            and all(needs_no_host(r, sampled) for r in reqs)
        )

    def launch(self, reqs: list[Req], after: InFlight | None) -> InFlight:
        """One decode step of `reqs`, sampled greedily on the device. With `after` (the step in
        flight, which holds every one of `reqs`), each row's input id is its token from it."""
        rows = None
        if after is not None:
            at = {id(r): i for i, r in enumerate(after.reqs)}
            rows = [at[id(r)] for r in reqs]
        logits = self.runner.decode_after(reqs, rows, None if after is None else after.tokens)
        tokens = self.pick(reqs, logits, after is not None)
        both = torch.cat((tokens, bad_row_mask(logits).long()))
        return InFlight(reqs, tokens, *copy_to_host(both))

    def pick(self, reqs: list[Req], logits: torch.Tensor, in_flight: bool) -> torch.Tensor:
        """Each row's token, on the device: the argmax, or a draw for sampled rows (each
        request's step counts the token still in flight)."""
        params = [r.params for r in reqs]
        if self.sampler is None or all(p.is_greedy for p in params):
            return logits.argmax(dim=-1)  # the sampler's greedy pick, without a host read
        steps = [len(r.token_ids) - r.prompt_len + in_flight for r in reqs]
        host = sampler_columns(params, logits.shape[-1])
        (bits,) = self.columns.stage([host.view(torch.int32)])  # float bits, exactly
        columns = bits.to(torch.int32).view(torch.float32)
        self.draws += 1
        return self.sampler.sample_on_device(logits, params, steps, columns, self.draws)


def needs_no_host(req: Req, sampled: bool) -> bool:
    """Whether the request's next token needs nothing from the host but its logits (and, when
    `sampled`, its sampling settings)."""
    p = req.params
    return (
        (p.is_greedy or sampled)
        and p.grammar is None
        and p.logprobs is None
        and not p.uses_controls
        and req.extend_len <= 1
    )


def continues(req: Req, in_flight: bool) -> bool:
    """Whether a running request takes another step after its next token (with a step in
    flight, that token is still to be appended)."""
    produced = req.output_len + in_flight
    return not req.finished and produced < req.params.max_new_tokens


def copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `values` that does not wait for the device: page-locked and
    non-blocking on CUDA, with the event to wait on before reading it."""
    if values.device.type != "cuda":
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
