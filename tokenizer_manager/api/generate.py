"""POST /generate, tessera's native API (SGLang's shape): text or input_ids, optional images and
raw sampling params in; text, output ids and meta_info out (streamed: cumulative objects)."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.multimodal import Modality
from runtime.sampler import SamplingParams
from tokenizer_manager.api.base import Serving, checked
from tokenizer_manager.mm_processor import MediaRef
from tokenizer_manager.protocol import APIError, GenerateRequest, new_id
from tokenizer_manager.tokenizer_manager import GenerateInput

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


def native_sampling(raw: dict[str, Any], room: int) -> SamplingParams:
    """`sampling_params` as SamplingParams; unknown names are a 400."""
    unknown = set(raw) - NATIVE_SAMPLING
    if unknown:
        raise APIError(f"unknown sampling params {sorted(unknown)}", param="sampling_params")
    values = dict(raw)
    values.setdefault("max_new_tokens", min(128, room))
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    try:
        return checked(SamplingParams(**values))
    except TypeError as e:
        raise APIError(str(e), param="sampling_params") from e


def native_body(rid: str, outputs: list[StrOutput]) -> dict[str, Any]:
    last = outputs[-1]
    return {
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


class NativeStream:
    """Each event is the whole response so far (SGLang's /generate stream)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.outputs: list[StrOutput] = []

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        self.outputs.append(out)
        return [native_body(self.rid, self.outputs)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return []


class GenerateServing(Serving[GenerateRequest]):
    def to_input(self, req: GenerateRequest) -> GenerateInput:
        if (req.text is None) == (req.input_ids is None):
            raise APIError("give exactly one of text and input_ids", param="text")
        images = [req.image_data] if isinstance(req.image_data, str) else req.image_data or []
        return GenerateInput(
            req.rid or new_id("gen"),
            req.stream,
            lambda room: native_sampling(req.sampling_params, room),
            req.sampling_params.get("max_new_tokens"),
            text=req.text,
            input_ids=req.input_ids,
            media=[MediaRef(Modality.IMAGE, url) for url in images],
        )

    def stream_writer(self, rid: str, req: GenerateRequest) -> NativeStream:
        return NativeStream(rid)

    def response(
        self, rid: str, req: GenerateRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        return native_body(rid, choices[0])
