"""A request inside the scheduler: the minimum state, everything else derived."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from runtime.io_struct import Finish, FinishKind, StageTimes, TokenizedGenerateReq
from runtime.mrope import decode_positions
from runtime.multimodal import MultimodalInputs
from runtime.sampling_controls import SamplingState
from runtime.sampling_params import SamplingParams, TokenLogprobs


@dataclass
class StageClock:
    """A request's scheduler-side timestamps (perf_counter, this rank's clock): they never take
    part in a decision, so ranks may disagree on them."""

    arrived: float
    scheduled: float | None = None  # its first prefill step started
    encoder: float = 0.0
    report: StageTimes | None = None  # set when its first token is sampled, sent once

    def prefill_step(self, start: float, encoder: float) -> None:
        if self.scheduled is None:
            self.scheduled = start
        self.encoder += encoder

    def first_token(self, now: float) -> None:
        queue = self.scheduled - self.arrived
        self.report = StageTimes(queue, self.encoder, now - self.scheduled)

    def take_report(self) -> StageTimes | None:
        report, self.report = self.report, None
        return report


@dataclass(eq=False)
class Req:
    """token_ids = prompt + outputs; kv_len tokens of it sit in the KV pool (the first
    `cached_tokens` of those came from the radix cache when the request was first admitted).

    Identity semantics (eq=False, invariant 12): two requests are the same only if they are the
    same object, so `in`, `remove` and `index` over lists of them never compare fields (tensors
    among them), and sets and dicts of them key by identity."""

    token_ids: list[int]
    mm: MultimodalInputs | None = None
    req_pool_index: int = -1  # its row in the request-to-token table, -1 when it has none
    kv_len: int = 0
    rid: str = ""
    prompt_len: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0
    cached_tokens: int = 0
    last_node: object | None = None
    finish: FinishKind | None = None
    finish_detail: str = ""
    sent_len: int = 0  # output tokens already reported to the detokenizer
    retractions: int = 0
    waited: int = 0  # steps admission held it back since it last entered the waiting queue
    encoder_pins: frozenset[int] = frozenset()  # items pinned in the encoder cache mid-prefill
    refused: bool = False  # its error finish is a refusal (the client's to fix), not a fault
    refused_param: str | None = None  # the request field a refusal names
    clock: StageClock = field(default_factory=lambda: StageClock(time.perf_counter()))
    sampling: SamplingState | None = None  # what its penalties and bad words need, kept per token
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # entry rank, if it asked
    index: int = 0  # which of the request's n choices
    fork_of: Req | None = None  # choice 0, whose prefill the other choices wait for and share
    wants_pixels: bool = False  # waits, out of every batch, for the pixels of keyed items
    waits_for_items: bool = False  # its next token is inside an awaited item: out of every batch
    shares_prompt: bool = False  # a request waits to match its prompt: into the tree at once

    @classmethod
    def from_message(
        cls,
        msg: TokenizedGenerateReq,
        eos: tuple[int, ...],
        arrival: int,
        vocab_size: int,
        media_token_ids: dict[str, int] | None = None,
    ) -> Req:
        """`media_token_ids`: modality -> its placeholder token id (for the penalties)."""
        ids, params = list(msg.input_ids), msg.sampling_params
        media = media_token_ids or {}
        items = msg.mm_inputs.items if msg.mm_inputs is not None else []
        swap = {item.pad_value: media[item.modality] for item in items if item.modality in media}
        return cls(
            token_ids=ids,
            mm=msg.mm_inputs,
            rid=msg.rid,
            prompt_len=len(ids),
            params=params,
            eos_token_ids=eos,
            arrival=arrival,
            sampling=SamplingState.for_request(params, ids, len(ids), vocab_size, swap),
        )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end it (held back by the sampler while min_tokens is not reached)."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return (*eos, *self.params.stop_token_ids)

    @property
    def mrope_delta(self) -> int:
        """A decoded token's MRoPE position is its sequence index plus this (see positions)."""
        return 0 if self.mm is None else self.mm.mrope_position_delta

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] MRoPE positions for sequence indices [start, end)."""
        prompt_len = 0 if self.mm is None else self.mm.mrope_positions.shape[1]
        delta = self.mrope_delta
        parts = []
        if start < prompt_len:
            parts.append(self.mm.mrope_positions[:, start : min(end, prompt_len)])
        if end > max(start, prompt_len):
            parts.append(decode_positions(torch.arange(max(start, prompt_len), end), delta))
        return torch.cat(parts, dim=1)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def output_len(self) -> int:
        """len(output_ids), without copying them (hot: per request per step)."""
        return len(self.token_ids) - self.prompt_len

    def outputs_from(self, start: int) -> list[int]:
        """output_ids[start:], copying only those."""
        return self.token_ids[self.prompt_len + start :]

    def keyed_items(self, start: int) -> frozenset[int]:
        """Hashes of the items sent by key only (no pixels: the ranks' encoder caches held them
        when the front end sent the request) whose placeholder run ends after token `start`."""
        items = self.mm.items if self.mm is not None else []
        return frozenset(
            i.hash for i in items if i.feature is None and not i.awaiting and i.span[1] > start
        )

    @property
    def ready_len(self) -> int:
        """Tokens from kv_len a chunk may compute now: up to the first item whose feature has
        not arrived (`awaiting`) and that the KV does not hold yet; `extend_len` when none.
        0 or less: nothing can run until its `ItemEmbeddings` come."""
        items = self.mm.items if self.mm is not None else []
        starts = [i.span[0] for i in items if i.awaiting and i.span[1] > self.kv_len]
        return min(starts) - self.kv_len if starts else self.extend_len

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def patches_entered(self, start: int, end: int) -> int:
        """Vision patches of the media items whose placeholder run starts in tokens
        [start, end): what a chunk over those tokens gives the encoder (an item a chunk enters
        is encoded whole; the chunks after it read its stored embedding)."""
        items = self.mm.items if self.mm is not None else []
        return sum(
            math.prod(i.grid_thw)
            for i in items
            if i.offsets and start <= i.span[0] < end
        )

    def item_safe_chunk(self, n: int) -> int:
        """A chunk of `n` tokens from kv_len, moved so that it ends inside no media item (a
        family whose items attend both ways computes each item in one forward): down to the
        start of an item it enters, or, when the item began before the chunk (its start is
        cached or is kv_len itself), on to the item's end."""
        end = self.kv_len + n
        for item in self.mm.items if self.mm is not None else []:
            for lo, hi in item.offsets:
                if lo < end < hi:
                    return lo - self.kv_len if lo > self.kv_len else hi - self.kv_len
        return n

    @property
    def extend_len(self) -> int:
        """Tokens still to prefill before the next token can be sampled."""
        return len(self.token_ids) - self.kv_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - self.output_len)

    def prefix_key(self) -> list[int]:
        """Radix key for matching: everything but the last token (whose logits we need); the
        media's pad values are in it (invariant 6)."""
        return self.token_ids[: len(self.token_ids) - 1]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        if self.sampling is not None:
            self.sampling.accept(token)
        self.check_finish(token)

    def check_finish(self, token: int) -> None:
        p, produced = self.params, len(self.token_ids) - self.prompt_len
        if token in self.stop_ids and produced >= p.min_tokens:
            self.finish, self.finish_detail = FinishKind.STOP, str(token)
        elif produced >= p.max_new_tokens:
            self.finish = FinishKind.LENGTH

    def outcome(self) -> Finish:
        """The finish as the other processes read it; an error says whether it was a refusal
        (the client's to fix, 400) or a fault (500)."""
        assert self.finish is not None
        if self.finish != FinishKind.ERROR:
            return Finish(self.finish, self.finish_detail)
        if self.refused:
            return Finish.error(self.finish_detail, 400, "request_refused", self.refused_param)
        return Finish.error(self.finish_detail)

    def abort(self, reason: FinishKind = FinishKind.ABORT, detail: str = "") -> None:
        self.finish, self.finish_detail = reason, detail
