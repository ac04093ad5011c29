"""The API's request and response vocabulary and tessera's error type.

Every field that OpenAI's chat and completions APIs define, and that vLLM's and SGLang's
extensions add, is named here: typed on the request models when tessera honours it, or listed in
a table of refusals (`CHAT_REFUSED`, `COMPLETION_REFUSED`) with the values that ask for nothing
(those are accepted) and the reason given in the 400 otherwise. Anything else a request carries
is ignored with one warning per field name (`api.fields.UnknownFields`), as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from runtime.sampling_params import MAX_N, SEED_RANGE

RID_MAX, RID_CHARS = 128, r"^[A-Za-z0-9._:-]+$"  # a client's request id: length and characters


class APIError(Exception):
    """An error the client sees as OpenAI's {"error": {...}} JSON with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - the JSON field's name
        retry_after: int | None = None,  # seconds, sent as a Retry-After header
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "internal_server_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# ---------------------------------------------------------------------- messages


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str


class ContentPart(BaseModel):
    """One part of a message's content; `check_part` says which fields each type needs."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "image_url", "video_url", "input_text"]
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None
    uuid: str | None = Field(default=None, min_length=1, max_length=256)  # the client's media id


PART_FIELD = {"text": "text", "input_text": "text", "image_url": "image_url"}


def check_part(part: ContentPart) -> ContentPart:
    """A part holds its type's field; a media part with a `uuid` may leave its media out (the
    server then serves the item it keeps under that id, or refuses the request)."""
    need = PART_FIELD.get(part.type, "video_url")
    if part.uuid is not None and need == "text":
        raise ValueError("`uuid` belongs to image_url and video_url parts")
    if getattr(part, need) is None and part.uuid is None:
        raise ValueError(f"a {part.type} part needs `{need}`")
    return part


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(BaseModel):
    """A conversation turn. Only an assistant turn may leave `content` null (with tool calls)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        if isinstance(value, list):
            return [check_part(ContentPart.model_validate(p)) for p in value]
        return value


# ---------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(BaseModel):
    """Fields shared by chat and completions requests, all honoured (engine fields only once
    the sampler has them: see api.openai_common.ENGINE_FIELDS)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None  # limits: runtime/sampling_params.py (MAX_STOP_*)
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices forked from one prefill
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None  # SGLang's name for include_stop_str_in_output
    request_id: str | None = Field(  # vLLM's name
        default=None, min_length=1, max_length=RID_MAX, pattern=RID_CHARS
    )
    rid: str | None = Field(default=None, min_length=1, max_length=RID_MAX, pattern=RID_CHARS)
    user: str | None = None  # also the session a request keeps to (api/fields.route_of)
    data_parallel_rank: int | None = Field(default=None, ge=0)  # the replica (--dp) to run on

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # none, auto, required or a named function (api/tool_choice.py)
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # checked in media/settings.py
    include_reasoning: bool = True  # vLLM; with --reasoning-parser
    separate_reasoning: bool = True  # SGLang; with --reasoning-parser
    stream_reasoning: bool = True  # SGLang; false: the thinking streams in one piece


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(BaseModel):
    """POST /tokenize in vLLM's shape: a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[Tool] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # checked in media/settings.py
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class GenerateRequest(BaseModel):
    """tessera's native endpoint: text or input_ids, optional images, raw sampling params."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    image_data: str | list[str] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # checked in media/settings.py
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=RID_MAX, pattern=RID_CHARS)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    model: str | None = None  # sglang-router sends null
    log_metrics: bool = True  # every request is counted in /metrics; false is refused
    # sglang-router sends the fields below at these defaults; a value that asks for something
    # is a 400 (NATIVE_TOP_REFUSED)
    return_hidden_states: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    background: bool = False
    no_logs: bool = False
    data_parallel_rank: int | None = Field(default=None, ge=0)  # the replica (--dp) to run on


# ---------------------------------------------------------------------- refusals

INERT = (None, False, [], {}, "")  # values that ask for nothing, for every refused field

LOGPROBS = "only the output tokens' logprobs are built, as token strings"
DISAGG = "disaggregated serving is not built"

# Fields both APIs refuse: name -> (further values that ask for nothing, the reason).
COMMON_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "best_of is not supported"),
    "use_beam_search": ((), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty only applies to beam search"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as they are"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported"),
    "prompt_logprobs": ((), LOGPROBS),
    "return_tokens_as_token_ids": ((), LOGPROBS),
    "return_token_ids": ((), "token ids are returned by /generate"),
    "guided_decoding_backend": (("llguidance", "auto"), "the grammar engine is llguidance"),
    "guided_whitespace_pattern": ((), "JSON is generated in its compact form"),
    "stop_regex": ((), "stop strings are matched literally"),
    "priority": ((), "requests are served first come, first served"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "custom_logit_processor": ((), "custom logits processors are not supported"),
    "custom_params": ((), "custom logits processors are not supported"),
    "vllm_xargs": ((), "no extension takes extra arguments"),
    "cache_salt": ((), "the prefix cache is not salted"),
    "extra_key": ((), "the prefix cache is not salted"),
    "kv_transfer_params": ((), DISAGG),
    "bootstrap_host": ((), DISAGG),
    "bootstrap_port": ((), DISAGG),
    "bootstrap_room": ((), DISAGG),
    "lora_path": ((), "LoRA adapters are not supported"),
    "session_params": ((), "sessions are not supported"),
    "return_hidden_states": ((), "hidden states are not returned"),
    "return_routed_experts": ((), "the served models have no experts"),
    "return_cached_tokens_details": ((), "usage.prompt_tokens_details.cached_tokens has them"),
    "custom_labels": ((), "metrics have no per-request labels"),
    "add_special_tokens": ((), "the prompt is tokenized as the model's tokenizer does"),
    "max_repetition_pattern_size": ((), "repetition detection is not supported"),
    "min_repetition_pattern_size": ((), "repetition detection is not supported"),
    "repetition_min_count": ((), "repetition detection is not supported"),
    "store": ((), "completions are not stored"),
    "service_tier": (("auto", "default"), "there is one service tier"),
}

CHAT_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    **COMMON_REFUSED,
    "functions": ((), "functions are not supported; send tools"),
    "function_call": (("none", "auto"), "functions are not supported; send tools"),
    "echo": ((), "chat echo is not supported"),
    "chat_template": ((), "the server's chat template is used"),
    "reasoning_effort": ((), "the served chat templates take no reasoning effort"),
    "reasoning": ((), "the served chat templates take no reasoning effort"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "verbosity": ((), "the served models take no verbosity"),
    "max_dynamic_patch": ((), "per-request media settings are not supported yet"),
    "min_dynamic_patch": ((), "per-request media settings are not supported yet"),
}

COMPLETION_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    **COMMON_REFUSED,
    "suffix": ((), "suffix (fill-in-the-middle) is not supported"),
    "prompt_embeds": ((), "prompt embeddings are not accepted"),
    "mm_processor_kwargs": ((), "completion prompts carry no media"),
}

# /generate's own fields that sglang-router forwards (at values that ask for nothing)
NATIVE_TOP_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "return_hidden_states": COMMON_REFUSED["return_hidden_states"],
    "return_bytes": ((), "output text is returned as text"),
    "return_entropy": ((), "token entropies are not returned"),
    "background": ((), "requests are served while the client waits"),
    "no_logs": ((), "request logging is not configurable per request"),
}

TOKENIZE_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    name: COMMON_REFUSED[name] for name in ("add_special_tokens",)
} | {"chat_template": CHAT_REFUSED["chat_template"]}

# Fields that describe the caller, not the answer: accepted, with nothing to do.
INFORMATIONAL = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})


# ---------------------------------------------------------------------- helpers


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
