"""POST /v1/completions: a prompt (text or token ids) in, text_completion objects out."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampler import SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.logprobs import CompletionLogprobs
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    common_refusals,
    include_usage,
    openai_sampling,
    refuse,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.protocol import APIError, CompletionRequest, new_id
from tokenizer_manager.tokenizer_manager import GenerateInput


def completion_sampling(req: CompletionRequest, room: int) -> SamplingParams:
    """A completions request's sampling fields as SamplingParams."""
    logprobs = None if req.logprobs in (None, False) else int(req.logprobs)
    return openai_sampling(req, req.max_tokens, room, logprobs)


def refuse_unsupported(req: CompletionRequest) -> None:
    refuse(
        common_refusals(req)
        + [
            (req.echo, "echo", "echo is not supported"),
            (req.suffix is not None, "suffix", "suffix is not supported"),
        ]
    )


def prompt_form(prompt: str | list[int] | list[str]) -> tuple[list[int] | None, str | None]:
    """(token ids, text): exactly one is set."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    return (list(prompt), None) if isinstance(prompt, list) else (None, prompt)


def completion_choice(
    index: int, outputs: list[StrOutput], logprobs: CompletionLogprobs
) -> dict[str, Any]:
    return {
        "index": index,
        "text": "".join(o.text for o in outputs),
        "logprobs": logprobs.build(outputs),
        "finish_reason": finish_reason(outputs[-1]),
    }


class CompletionStream:
    """A completions request's chunks: text deltas (with their tokens' logprobs when asked),
    then usage if asked."""

    def __init__(self, envelope: Envelope, include_usage: bool) -> None:
        self.envelope = envelope
        self.include_usage = include_usage
        self.logprobs: dict[int, CompletionLogprobs] = {}  # per choice: offsets run on

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        if not out.text and finish_reason(out) is None and not out.logprobs:
            return []
        logprobs = self.logprobs.setdefault(index, CompletionLogprobs())
        choice = completion_choice(index, [out], logprobs)
        return [self.envelope.wrap([choice], None, chunk=True)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


class CompletionServing(OpenAIServing[CompletionRequest]):
    objects = ("text_completion", "text_completion")

    def to_input(self, req: CompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        refuse_unsupported(req)
        ids, text = prompt_form(req.prompt)
        return GenerateInput(
            new_id("cmpl"),
            req.stream,
            lambda room: completion_sampling(req, room),
            req.max_tokens,
            text=text,
            input_ids=ids,
        )

    def stream_writer(self, rid: str, req: CompletionRequest) -> CompletionStream:
        return CompletionStream(self.envelope(rid), include_usage(req))

    def response(
        self, rid: str, req: CompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [
            completion_choice(i, outputs, CompletionLogprobs()) for i, outputs in enumerate(choices)
        ]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
