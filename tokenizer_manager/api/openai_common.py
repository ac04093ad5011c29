"""What chat and completions share: the response envelope, the translation of their common
sampling fields (with the checkpoint's defaults for fields left unset) and the field checks."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.model_config import GenerationDefaults
from runtime.sampling_params import SamplingParams
from tokenizer_manager.api.base import R, Serving, checked, model_name
from tokenizer_manager.api.fields import engine_value, sampler_has
from tokenizer_manager.api.structured import openai_constraint
from tokenizer_manager.api.usage import running_usage, usage_json
from tokenizer_manager.protocol import APIError, SamplingFields, new_id, now

# request field -> (SamplingParams attribute, the value that asks for nothing)
ENGINE_FIELDS: dict[str, tuple[str, Any]] = {
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_tokens": ("min_tokens", 0),
    "logit_bias": ("logit_bias", {}),
    "allowed_token_ids": ("allowed_token_ids", None),
    "bad_words": ("bad_words", []),
    "include_stop_str_in_output": ("include_stop_str_in_output", False),
    "no_stop_trim": ("include_stop_str_in_output", False),
}


class Envelope:
    """The fields around every response object and chunk of one request."""

    def __init__(self, rid: str, model: str, obj: str, chunk_obj: str) -> None:
        self.rid, self.model, self.obj, self.chunk_obj = rid, model, obj, chunk_obj
        self.created = now()

    def wrap(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, chunk: bool
    ) -> dict[str, Any]:
        body = {
            "id": self.rid,
            "object": self.chunk_obj if chunk else self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, choices: list[dict[str, Any]], lasts: list[StrOutput]) -> dict[str, Any]:
        """The response object: the choices and the request's usage."""
        return self.wrap(choices, usage_json(lasts), chunk=False)


class OpenAIStream:
    """What the chat and completions streams share: usage in each chunk when asked
    (continuous_usage_stats: the opening chunks too, with no tokens yet) and at the end."""

    def __init__(self, envelope: Envelope, usage: tuple[bool, bool]) -> None:
        self.envelope = envelope
        self.include_usage, self.continuous_usage = usage

    def chunk(
        self, choice: dict[str, Any], out: StrOutput, completion_tokens: int | None = None
    ) -> dict[str, Any]:
        """One choice's chunk; `out`: that choice's latest output, or its prompt's first
        output for an opening chunk (`completion_tokens` 0)."""
        usage = running_usage(out, completion_tokens) if self.continuous_usage else None
        return self.envelope.wrap([choice], usage, chunk=True)

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self.envelope.wrap([], usage_json(lasts), chunk=True)]


class OpenAIServing(Serving[R]):
    """Chat and completions: the same envelope, differing in their object names."""

    objects: tuple[str, str]  # the response's "object", a chunk's "object"
    id_prefix: str

    def envelope(self, rid: str) -> Envelope:
        return Envelope(rid, model_name(self.tm), *self.objects)

    def request_id(self, req: SamplingFields) -> str:
        """The client's id (vLLM's request_id, SGLang's rid) under this API's prefix."""
        given = req.request_id or req.rid
        return f"{self.id_prefix}-{given}" if given else new_id(self.id_prefix)


def stream_usage(req: SamplingFields) -> tuple[bool, bool]:
    """(usage at the end, usage in every chunk) as stream_options asks."""
    opts = req.stream_options
    return (bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats))


def pick(given: Any, default: Any, fallback: Any) -> Any:
    return given if given is not None else default if default is not None else fallback


def output_cap(max_tokens: int | None, default: int | None, room: int) -> int:
    """The client's cap, else the checkpoint's max_new_tokens within the room, else the room."""
    if max_tokens is not None:
        return max_tokens
    return min(room, default) if default is not None else room


def engine_values(req: SamplingFields, defaults: GenerationDefaults) -> dict[str, Any]:
    """The engine fields the request sets (a 400 for one SamplingParams lacks), and the
    checkpoint's repetition_penalty where SamplingParams has it and the request is silent."""
    values: dict[str, Any] = {}
    for name, (attribute, inert) in ENGINE_FIELDS.items():
        value = getattr(req, name)
        if value is not None and value != inert:
            values |= engine_value(name, attribute, convert(name, value))
    grammar = openai_constraint(req)
    if grammar is not None:
        values["grammar"] = grammar
    default = defaults.repetition_penalty
    if req.repetition_penalty is None and default is not None and sampler_has("repetition_penalty"):
        values["repetition_penalty"] = default
    return values


def convert(name: str, value: Any) -> Any:
    """logit_bias comes with token ids as JSON object keys."""
    if name != "logit_bias":
        return value
    try:
        return {int(token): float(bias) for token, bias in value.items()}
    except ValueError as e:
        raise APIError("logit_bias keys must be token ids", param="logit_bias") from e


def openai_sampling(
    req: SamplingFields,
    max_tokens: int | None,
    room: int,
    defaults: GenerationDefaults,
    engine: dict[str, Any],
) -> SamplingParams:
    """The sampling fields chat and completions share, as SamplingParams."""
    top_k = pick(req.top_k, defaults.top_k, -1)
    params = SamplingParams(
        temperature=pick(req.temperature, defaults.temperature, 1.0),
        top_p=pick(req.top_p, defaults.top_p, 1.0),
        top_k=-1 if top_k == 0 else top_k,
        min_p=pick(req.min_p, defaults.min_p, 0.0),
        seed=req.seed,
        max_new_tokens=output_cap(max_tokens, defaults.max_new_tokens, room),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        **engine,
    )
    return checked(params)
