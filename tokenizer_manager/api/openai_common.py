"""What chat and completions share: the response envelope, the sampling fields they have in
common and the refusals for fields tessera does not build."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampler import SamplingParams
from tokenizer_manager.api.base import R, Serving, checked, model_name
from tokenizer_manager.api.usage import usage_json
from tokenizer_manager.protocol import APIError, SamplingFields, now


class Envelope:
    """The fields around every response object and chunk of one request."""

    def __init__(self, rid: str, model: str, obj: str, chunk_obj: str) -> None:
        self.rid, self.model, self.obj, self.chunk_obj = rid, model, obj, chunk_obj
        self.created = now()

    def wrap(
        self, choices: list[dict[str, Any]], lasts: list[StrOutput] | None, chunk: bool
    ) -> dict[str, Any]:
        body = {
            "id": self.rid,
            "object": self.chunk_obj if chunk else self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if lasts is not None:
            body["usage"] = usage_json(lasts)
        return body


class OpenAIServing(Serving[R]):
    """Chat and completions: the same envelope, differing in their object names."""

    objects: tuple[str, str]  # the response's "object", a chunk's "object"

    def envelope(self, rid: str) -> Envelope:
        return Envelope(rid, model_name(self.tm), *self.objects)


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def refuse(checks: list[tuple[bool, str, str]]) -> None:
    """A 400 naming the first field whose check is true."""
    for bad, param, message in checks:
        if bad:
            raise APIError(message, param=param, code="unsupported_parameter")


def common_refusals(req: SamplingFields) -> list[tuple[bool, str, str]]:
    return [
        (req.use_beam_search, "use_beam_search", "beam search is not supported"),
        (
            req.best_of not in (None, req.n),
            "best_of",
            "best_of other than n needs beam search, which is not supported",
        ),
    ]


def openai_sampling(
    req: SamplingFields, max_tokens: int | None, room: int, logprobs: int | None
) -> SamplingParams:
    """The sampling fields chat and completions share, as SamplingParams (`logprobs`: the
    number of alternatives per token, None when off; each API reads it from its own fields)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_new_tokens=room if max_tokens is None else max_tokens,
        stop=stop,
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        min_tokens=req.min_tokens,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or [],
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        n=req.n,
    )
    return checked(params)
