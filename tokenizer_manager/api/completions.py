"""POST /v1/completions: a prompt (text or token ids) in, text_completion objects out."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampler import SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.fields import refuse_fields
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    engine_values,
    openai_sampling,
    stream_usage,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.protocol import COMPLETION_REFUSED, APIError, CompletionRequest
from tokenizer_manager.tokenizer_manager import GenerateInput


def prompt_form(prompt: Any) -> tuple[list[int] | None, str | None]:
    """(token ids, text): exactly one is set."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    return (list(prompt), None) if isinstance(prompt, list) else (None, prompt)


def completion_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


class CompletionStream:
    """A completions request's chunks: text deltas, then usage if asked."""

    def __init__(self, envelope: Envelope, usage: tuple[bool, bool]) -> None:
        self.envelope = envelope
        self.include_usage, self.continuous_usage = usage

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        if not out.text and reason is None:
            return []
        choice = completion_choice(index, out.text, reason)
        usage = [out] if self.continuous_usage else None
        return [self.envelope.wrap([choice], usage, chunk=True)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


class CompletionServing(OpenAIServing[CompletionRequest]):
    objects = ("text_completion", "text_completion")
    id_prefix = "cmpl"

    def to_input(self, req: CompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, COMPLETION_REFUSED)
        refuse_fields(req, COMPLETION_REFUSED)
        engine = engine_values(req, self.ctx.defaults)
        ids, text = prompt_form(req.prompt)
        return GenerateInput(
            self.request_id(req),
            req.stream,
            lambda room: self.sampling(req, room, engine),
            req.max_tokens,
            text=text,
            input_ids=ids,
        )

    def sampling(self, req: CompletionRequest, room: int, engine: dict[str, Any]) -> SamplingParams:
        """A completions request's sampling fields as SamplingParams."""
        return openai_sampling(req, req.max_tokens, room, self.ctx.defaults, engine)

    def stream_writer(self, rid: str, req: CompletionRequest) -> CompletionStream:
        return CompletionStream(self.envelope(rid), stream_usage(req))

    def response(
        self, rid: str, req: CompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [
            completion_choice(i, "".join(o.text for o in outputs), finish_reason(outputs[-1]))
            for i, outputs in enumerate(choices)
        ]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
