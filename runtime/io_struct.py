"""Messages between tessera's processes, one dataclass per kind (sent pickled over ZMQ/Gloo)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.multimodal import MultimodalInputs
from runtime.sampler import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """TokenizerManager -> scheduler: a prompt ready to run (pad values already in input_ids)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None = None
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class ShutdownReq:
    """Every scheduler rank leaves its loop and exits cleanly."""


@dataclass
class FlushCacheReq:
    """Drop every cached prefix and encoder output (only honoured while idle)."""


@dataclass
class GetServerInfoReq:
    """Ask rank 0 for KV and cache counters; answered with a ServerInfo."""


@dataclass
class ServerInfo:
    kv_total: int
    kv_free: int
    kv_evictable: int
    kv_protected: int
    running: int
    waiting: int
    req_slots_used: int = 0
    radix: dict = field(default_factory=dict)
    encoder_cache: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    encoder_plans: dict = field(default_factory=dict)  # auto encoder mode: calls per plan kind


@dataclass
class ReqStart:
    """A request's detokenization constants, sent to the detokenizer once, at admission.

    Stop strings are bounded (runtime/sampler.py: MAX_STOP_STRINGS strings of at most
    MAX_STOP_CHARS characters each), checked at the door."""

    rid: str
    stop: tuple[str, ...] = ()  # stop strings, trimmed by the detokenizer
    skip_special_tokens: bool = True


@dataclass
class StageTimes:
    """Where one request's time went inside the scheduler (entry rank's clock, seconds); sent
    once, with the request's first token."""

    queue: float  # taken in by the scheduler loop -> its first prefill step starts
    encoder: float  # vision encoder time of the prefill steps whose chunk held its media
    prefill: float  # its first prefill step starts -> its first token is sampled (encoder included)


@dataclass
class ReqOutput:
    """New tokens of one request since the previous message (only what changed)."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None  # {"type": "stop"|"length"|"abort"|"error", "detail"}
    stages: StageTimes | None = None  # with the first token only


@dataclass
class BatchTokenOut:
    """Scheduler rank 0 -> detokenizer: the requests admitted in one step (read first), then the
    outputs of that step."""

    outputs: list[ReqOutput]
    started: list[ReqStart] = field(default_factory=list)


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class StrOutput:
    """Detokenized text of one request since the previous message."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None  # a matched stop string gives {"type": "stop", "matched"}
    stages: StageTimes | None = None  # the scheduler's stage times, with the first token only


@dataclass
class BatchStrOut:
    """Detokenizer -> TokenizerManager."""

    outputs: list[StrOutput]
