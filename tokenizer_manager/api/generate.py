"""POST /generate, tessera's native API (SGLang's shape): text or input_ids, optional images and
raw sampling params in; text, output ids and meta_info out (streamed: cumulative objects)."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.model_config import GenerationDefaults
from runtime.multimodal import Modality
from runtime.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenizer_manager.api.base import Serving, check_model, checked
from tokenizer_manager.api.fields import (
    Refusals,
    asks_nothing,
    engine_value,
    refuse_fields,
    sampler_has,
    unsupported,
)
from tokenizer_manager.api.logprobs import native_logprobs
from tokenizer_manager.api.openai_common import ENGINE_FIELDS
from tokenizer_manager.api.structured import NATIVE_READERS, read_constraint
from tokenizer_manager.media.mm_processor import MediaRef
from tokenizer_manager.protocol import NATIVE_TOP_REFUSED, APIError, GenerateRequest, new_id
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager

NATIVE_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
}
RENAMED = {"sampling_seed": "seed"}  # SGLang's name -> tessera's
# SGLang's engine fields: the OpenAI names, and min_new_tokens for min_tokens
NATIVE_ENGINE = {
    **{name: ENGINE_FIELDS[name] for name in ("presence_penalty", "frequency_penalty")},
    **{name: ENGINE_FIELDS[name] for name in ("repetition_penalty", "logit_bias", "no_stop_trim")},
    "min_new_tokens": ENGINE_FIELDS["min_tokens"],
}
NATIVE_REFUSED: Refusals = {
    "n": ((1,), "only n=1 is supported"),
    "custom_params": ((), "custom logits processors are not supported"),
    "stream_interval": ((1,), "every output is streamed as it comes"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as they are"),
}


def native_sampling(
    raw: dict[str, Any], room: int, defaults: GenerationDefaults, logprobs: int | None = None
) -> SamplingParams:
    """`sampling_params` as SamplingParams; a name tessera does not know is a 400.
    `logprobs`: top_logprobs_num when return_logprob is set, else None."""
    values = {RENAMED.get(k, k): v for k, v in raw.items()}
    known = NATIVE_SAMPLING | NATIVE_ENGINE.keys() | NATIVE_REFUSED.keys() | NATIVE_READERS.keys()
    unknown = set(values) - known
    if unknown:
        raise APIError(f"unknown sampling params {sorted(unknown)}", param="sampling_params")
    grammar = read_constraint(values, NATIVE_READERS, "sampling_params.")
    for name in NATIVE_READERS:
        values.pop(name, None)
    if grammar is not None:
        values["grammar"] = grammar
    for name, (inert, reason) in NATIVE_REFUSED.items():
        if not asks_nothing(values.pop(name, None), inert):
            raise unsupported(f"sampling_params.{name}", reason)
    for name, (attribute, inert) in NATIVE_ENGINE.items():
        value = values.pop(name, None)
        if value is not None and value != inert:
            values |= engine_value(f"sampling_params.{name}", attribute, value)
    for name, default in defaults.in_force().items():
        if name != "repetition_penalty" or sampler_has(name):
            values.setdefault(name, min(default, room) if name == "max_new_tokens" else default)
    values.setdefault("max_new_tokens", min(128, room))
    values["logprobs"] = logprobs
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    try:
        return checked(SamplingParams(**values))
    except TypeError as e:
        raise APIError(str(e), param="sampling_params") from e


def native_body(
    rid: str, outputs: list[StrOutput], text_in_logprobs: bool = False
) -> dict[str, Any]:
    last = outputs[-1]
    body = {
        "text": "".join(o.text for o in outputs),
        "output_ids": [t for o in outputs for t in o.token_ids],
        "meta_info": {
            "id": rid,
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "cached_tokens": last.cached_tokens,
            "finish_reason": last.finish_reason and last.finish_reason.to_json(),
        },
    }
    if any(out.logprobs is not None for out in outputs):
        body["meta_info"].update(native_logprobs(outputs, text_in_logprobs))
    return body


def native_logprobs_num(req: GenerateRequest) -> int | None:
    if not req.return_logprob:
        return None
    if not 0 <= req.top_logprobs_num <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs_num must be in [0, {MAX_LOGPROBS}]", param="top_logprobs_num")
    return req.top_logprobs_num


class NativeStream:
    """Each event is the whole response so far (SGLang's /generate stream)."""

    def __init__(self, rid: str, text_in_logprobs: bool = False) -> None:
        self.rid = rid
        self.text_in_logprobs = text_in_logprobs
        self.outputs: list[StrOutput] = []

    def opening(self, firsts: list[StrOutput]) -> list[dict[str, Any]]:
        return []

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        self.outputs.append(out)
        return [native_body(self.rid, self.outputs, self.text_in_logprobs)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return []


def check_native_fields(tm: TokenizerManager, req: GenerateRequest) -> None:
    """The fields sglang-router adds to every /generate body: honoured at their defaults,
    a 400 naming the field otherwise."""
    check_model(tm, req.model)
    refuse_fields(req, NATIVE_TOP_REFUSED)
    if not req.log_metrics:
        raise unsupported("log_metrics", "every request is counted in /metrics")


class GenerateServing(Serving[GenerateRequest]):
    def to_input(self, req: GenerateRequest) -> GenerateInput:
        check_native_fields(self.tm, req)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("give exactly one of text and input_ids", param="text")
        images = [req.image_data] if isinstance(req.image_data, str) else req.image_data or []
        return GenerateInput(
            req.rid or new_id("gen"),
            req.stream,
            lambda room: native_sampling(
                req.sampling_params, room, self.ctx.defaults, native_logprobs_num(req)
            ),
            req.sampling_params.get("max_new_tokens"),
            text=req.text,
            input_ids=req.input_ids,
            media=[MediaRef(Modality.IMAGE, url) for url in images],
            mm_processor_kwargs=req.mm_processor_kwargs,
        )

    def stream_writer(self, rid: str, req: GenerateRequest) -> NativeStream:
        return NativeStream(rid, req.return_text_in_logprobs)

    def response(
        self, rid: str, req: GenerateRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        return native_body(rid, choices[0], req.return_text_in_logprobs)
