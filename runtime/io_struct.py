"""Messages between tessera's processes, one dataclass per kind (sent pickled over ZMQ/Gloo).

Each channel carries one union of them (end of the module): `ToScheduler` (TokenizerManager ->
scheduler rank 0, which forwards the same messages to the other ranks: `RankBroadcast`),
`ToDetokenizer` (scheduler rank 0 -> detokenizer; and `ForgetReqs` from the TokenizerManager),
`ToTokenizer` (detokenizer -> TokenizerManager). Every receiver dispatches with a `match` over
its channel's union and raises `UnknownMessage` for anything else. A child process reports its
start-up to `launch.py` once, as a `ReadyReport`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, NamedTuple

from runtime.multimodal import MultimodalInputs
from runtime.sampling_params import SamplingParams, TokenLogprobs


class FinishKind(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Finish:
    """How a request ended: made by the scheduler (or the detokenizer, for a stop string or its
    own failure), read by the detokenizer, the TokenizerManager and the HTTP layer."""

    kind: FinishKind
    detail: str = ""  # stop: the stop token id; error: what went wrong
    matched: str | None = None  # the stop string the detokenizer matched
    status: int = 0  # error: the client's HTTP status (400 a refusal, 500 a fault, 503 shutdown)
    code: str = ""  # error: the OpenAI error code
    param: str | None = None  # error: the request field at fault (a 400 names it)

    @classmethod
    def error(
        cls, detail: str, status: int = 500, code: str = "internal_error", param: str | None = None
    ) -> Finish:
        return cls(FinishKind.ERROR, detail, status=status, code=code, param=param)

    @property
    def is_error(self) -> bool:
        return self.kind == FinishKind.ERROR

    @property
    def completed(self) -> bool:
        """The request ran to its natural end (a stop or its length)."""
        return self.kind in (FinishKind.STOP, FinishKind.LENGTH)

    def to_json(self) -> dict[str, object]:
        """The finish as `/generate` reports it: {"type", ...} with the fields that are set."""
        data = {k: v for k, v in asdict(self).items() if v not in ("", 0, None) and k != "kind"}
        return {"type": self.kind.value, **data}


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
    index: int | None = None  # one of the request's n choices; None: all of them


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
class PixelsWanted:
    """Scheduler rank 0 -> (detokenizer) -> TokenizerManager: a request sent some items by key
    only (their pixels were sent before and the ranks' encoder caches held them), and at least
    one rank no longer holds these; the request waits, out of every batch, for `ItemPixels`."""

    rid: str
    hashes: list[int]


@dataclass
class ForgetReqs:
    """TokenizerManager -> detokenizer: these requests ended without a finish from their
    scheduler (their replica died); their state goes, and whatever still arrives for them is
    dropped."""

    rids: list[str]


@dataclass
class ItemPixels:
    """TokenizerManager -> scheduler: the pixels `PixelsWanted` asked for, by item hash (a
    shared-memory file by name, or a tensor out of band: runtime/transport/frames.py)."""

    rid: str
    features: dict[int, object]


@dataclass
class ItemEmbeddings:
    """TokenizerManager -> scheduler (--encoder-urls): the items a request was sent without
    (`MultimodalDataItem.awaiting`), once its encoder jobs ended: each item's embedding rows by
    hash (`embedded`), or, when no encoder server answered and --encoder-fallback is local, its
    pixels for the ranks to encode. Tensors go out of band, shared files by name
    (runtime/transport/frames.py); for a request that has ended, it is dropped."""

    rid: str
    features: dict[int, object]
    embedded: bool = True


@dataclass
class SchedulerCounters:
    """What the scheduler has done since start-up (on the entry rank)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # prefill steps that also carried the running decodes
    prompt_tokens_computed: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    admission_preemptions: int = 0  # of the retractions: KV taken for a waiting request
    recomputed_tokens: int = 0  # prompt and output tokens computed again after a retraction
    finished: int = 0
    aborted: int = 0
    refused: int = 0
    failed: int = 0  # requests ended by a fault of their own
    faults_injected: int = 0  # hits of a test's faults (scheduler/input_checks.py); 0 in production
    forced_tokens: int = 0  # appended by jump-forward: a decode step saved for each
    pixels_wanted: int = 0  # requests whose keyed items some rank lacked (pixels asked for)
    deferred_to_share: int = 0  # admissions put off a step to match a batch-mate's prompt
    encoder_deferred: int = 0  # admissions put off a step by the step's encoder budget
    parked: int = 0  # cut requests that waited, holding their KV, for an awaited item
    unparked: int = 0  # of those: gave their KV back for a request that could run


@dataclass
class EncoderCacheCounters:
    hits: int = 0  # items every rank had cached
    misses: int = 0  # items encoded because at least one rank lacked them
    peer_misses: int = 0  # of the misses: items this rank had but a peer lacked
    items_encoded: int = 0
    encode_calls: int = 0
    evictions: int = 0
    not_stored: int = 0  # encoded items that did not fit (too large, or pinned entries in the way)
    encode_seconds: float = 0.0  # host time in the encoder (on CUDA: until its kernels are queued)


@dataclass
class EncoderCacheStats(EncoderCacheCounters):
    """The encoder cache's counters and sizes; `pins` must be 0 when the server is idle."""

    capacity_bytes: int = 0
    bytes: int = 0
    entries: int = 0
    pins: int = 0
    pinned_bytes: int = 0


@dataclass
class RadixStats:
    cached_tokens: int = 0


@dataclass
class ServerInfo:
    kv_total: int
    kv_free: int
    kv_evictable: int
    kv_protected: int
    running: int
    waiting: int
    req_slots_used: int = 0
    radix: RadixStats = field(default_factory=RadixStats)
    encoder_cache: EncoderCacheStats = field(default_factory=EncoderCacheStats)
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    encoder_plans: dict[str, int] = field(default_factory=dict)  # auto encoder mode: per kind
    gc_frozen: int = 0  # objects this rank froze once ready (runtime/allocator.py)
    replica: int = 0  # the data-parallel replica whose entry rank answered

    @classmethod
    def total(cls, infos: list[ServerInfo]) -> ServerInfo:
        """Several replicas' counters and sizes added up, field by field (one: its own)."""
        if len(infos) == 1:
            return infos[0]
        if not infos:
            return cls(0, 0, 0, 0, 0, 0)
        return dataclasses.replace(added(infos), replica=0)


def added(objs: list) -> object:
    """Dataclasses of one type summed field by field: numbers added, dicts by key, nested
    dataclasses likewise."""
    first, values = objs[0], {}
    for f in dataclasses.fields(first):
        column = [getattr(o, f.name) for o in objs]
        if dataclasses.is_dataclass(column[0]):
            values[f.name] = added(column)
        elif isinstance(column[0], dict):
            values[f.name] = {k: sum(d.get(k, 0) for d in column) for d in column for k in d}
        else:
            values[f.name] = sum(column)
    return type(first)(**values)


@dataclass
class ReqStart:
    """A request's detokenization constants, sent to the detokenizer once, at admission
    (invariant 13).

    Stop strings are bounded (runtime/sampling_params.py: MAX_STOP_STRINGS strings of at most
    MAX_STOP_CHARS characters each), checked at the door."""

    rid: str
    stop: tuple[str, ...] = ()  # stop strings, trimmed by the detokenizer
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the matched stop string or stop token's text
    min_tokens: int = 0  # stop strings are not matched before this many output tokens
    index: int = 0  # which of the request's n choices

    @classmethod
    def of(cls, rid: str, p: SamplingParams, index: int = 0) -> ReqStart:
        stop, skip = tuple(p.stop), p.skip_special_tokens
        return cls(rid, stop, skip, p.include_stop_str_in_output, p.min_tokens, index)


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
    finish_reason: Finish | None = None
    stages: StageTimes | None = None  # with the first token only
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    index: int = 0  # which of the request's n choices


class PrefixCut(NamedTuple):
    """A prefix a replica's radix cache no longer holds: it evicted the leaf that began at token
    `depth` with token `token` under the path `ids[:depth]`, `digest` being
    `prefix_digest(ids[: depth + 1])`. Whatever extends `ids[: depth + 1]` is gone with it."""

    depth: int
    token: int
    digest: int


def prefix_digest(ids: Sequence[int]) -> int:
    """The digest of a token prefix both sides compute alike (ints hash to themselves and a
    tuple's hash is not salted per process)."""
    return hash(tuple(ids))


@dataclass
class BatchTokenOut:
    """Scheduler rank 0 -> detokenizer: the requests admitted in one step (read first), then the
    outputs of that step, and what the replica's radix cache evicted in it (for the front end's
    dispatcher)."""

    outputs: list[ReqOutput]
    started: list[ReqStart] = field(default_factory=list)
    evicted: list[PrefixCut] = field(default_factory=list)
    replica: int = 0  # the data-parallel replica whose entry rank sent it


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""
    replica: int = 0  # the data-parallel replica whose entry rank answered


@dataclass
class TokenText:
    """A token as logprobs show it: its text decoded alone, its exact bytes, its logprob."""

    token_id: int
    text: str
    bytes: list[int]
    logprob: float


@dataclass
class OutputLogprobs:
    """One output token's logprobs: the chosen token and the top alternatives (highest first)."""

    chosen: TokenText
    top: list[TokenText]


@dataclass
class StrOutput:
    """Detokenized text of one request since the previous message."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: Finish | None = None
    stages: StageTimes | None = None  # the scheduler's stage times, with the first token only
    logprobs: list[OutputLogprobs] | None = None  # one per token of token_ids, when asked
    index: int = 0  # which of the request's n choices


@dataclass
class BatchStrOut:
    """Detokenizer -> TokenizerManager; `evicted` and `replica` passed on from the batch."""

    outputs: list[StrOutput]
    evicted: list[PrefixCut] = field(default_factory=list)
    replica: int = 0

    @property
    def empty(self) -> bool:
        return not self.outputs and not self.evicted


# ---------------------------------------------------------------------- one union per channel

# TokenizerManager -> scheduler: what the scheduler's loop handles, then the channel as a whole
SchedulerRequest = (
    TokenizedGenerateReq
    | AbortReq
    | FlushCacheReq
    | GetServerInfoReq
    | ItemPixels
    | ItemEmbeddings
)
ToScheduler = SchedulerRequest | ShutdownReq
# scheduler rank 0 -> the other ranks: the messages rank 0 received, forwarded unchanged
RankBroadcast = ToScheduler
# scheduler rank 0 -> detokenizer: a step's outputs, the replies to control requests
# and TokenizerManager -> detokenizer: the requests of a replica that died
ToDetokenizer = (
    BatchTokenOut | FlushCacheOut | ServerInfo | PixelsWanted | ShutdownReq | ForgetReqs
)
# detokenizer -> TokenizerManager: text, and the replies passed through
ToTokenizer = BatchStrOut | FlushCacheOut | ServerInfo | PixelsWanted | ShutdownReq


class UnknownMessage(TypeError):
    """A message that is not in its channel's union: a sender and a receiver that disagree
    (a bug), never the client's doing. Raised, never ignored."""

    def __init__(self, msg: object, channel: str):
        super().__init__(f"{channel}: unknown message {type(msg).__qualname__}")


@dataclass(frozen=True)
class ReadyReport:
    """A child process -> launch.py, once, at start-up: ready (with what the front door needs
    from scheduler rank 0), or the traceback of why it could not start."""

    status: Literal["ready", "error"]
    rank: int | None = None  # scheduler ranks only
    kv_total: int | None = None  # KV pool size in tokens (scheduler ranks)
    context_length: int | None = None  # (scheduler ranks)
    error: str = ""

    @classmethod
    def failed(cls, error: str, rank: int | None = None) -> ReadyReport:
        return cls("error", rank=rank, error=error)

    @property
    def ready(self) -> bool:
        return self.status == "ready"
