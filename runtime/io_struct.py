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
    radix: dict = field(default_factory=dict)
    encoder_cache: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    encoder_plans: dict = field(default_factory=dict)  # auto encoder mode: calls per plan kind


@dataclass
class ReqOutput:
    """New tokens of one request since the previous message."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None  # {"type": "stop"|"length"|"abort"|"error", "detail"}
    stop: tuple[str, ...] = ()  # stop strings, trimmed by the detokenizer
    skip_special_tokens: bool = True


@dataclass
class BatchTokenOut:
    """Scheduler rank 0 -> detokenizer: outputs of one scheduler step."""

    outputs: list[ReqOutput]


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


@dataclass
class BatchStrOut:
    """Detokenizer -> TokenizerManager."""

    outputs: list[StrOutput]
