"""POST /v1/chat/completions: messages in, chat.completion objects (or chunks) out."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampler import MAX_LOGPROBS, SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.logprobs import chat_logprobs
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    common_refusals,
    include_usage,
    openai_sampling,
    refuse,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.protocol import APIError, ChatCompletionRequest, new_id
from tokenizer_manager.tokenizer_manager import GenerateInput


def chat_sampling(req: ChatCompletionRequest, room: int) -> SamplingParams:
    """A chat request's sampling fields as SamplingParams."""
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return openai_sampling(req, req.max_completion_tokens or req.max_tokens, room, logprobs)


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    fmt = (req.response_format or {}).get("type", "text")
    top = req.top_logprobs
    refuse(
        common_refusals(req)
        + [
            (bool(req.tools), "tools", "tools are not supported"),
            (fmt != "text", "response_format", "only text responses are supported"),
        ]
    )
    if top is not None and not (0 <= top <= MAX_LOGPROBS and (req.logprobs or top == 0)):
        raise APIError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}] and needs logprobs: true",
            param="top_logprobs",
        )


class ChatStream:
    """A chat request's chunks: the role first (for each choice), then content deltas (with
    their tokens' logprobs when asked), then usage if asked."""

    def __init__(self, envelope: Envelope, include_usage: bool, n: int = 1) -> None:
        self.envelope = envelope
        self.include_usage = include_usage
        self.n = n

    def opening(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        choices = [{"index": i, "delta": delta, "finish_reason": None} for i in range(self.n)]
        return [self.envelope.wrap([choice], None, chunk=True) for choice in choices]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        if not out.text and reason is None and not out.logprobs:
            return []
        delta = {"content": out.text} if out.text else {}
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        if out.logprobs is not None:
            choice["logprobs"] = chat_logprobs([out])
        return [self.envelope.wrap([choice], None, chunk=True)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


def chat_choice(index: int, outputs: list[StrOutput]) -> dict[str, Any]:
    message = {"role": "assistant", "content": "".join(o.text for o in outputs)}
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(outputs),
        "finish_reason": finish_reason(outputs[-1]),
    }


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    objects = ("chat.completion", "chat.completion.chunk")

    def to_input(self, req: ChatCompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        refuse_unsupported(req)
        return GenerateInput(
            new_id("chatcmpl"),
            req.stream,
            lambda room: chat_sampling(req, room),
            req.max_completion_tokens or req.max_tokens,
            messages=[m.model_dump(exclude_none=True) for m in req.messages],
        )

    def stream_writer(self, rid: str, req: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self.envelope(rid), include_usage(req), req.n)

    def response(
        self, rid: str, req: ChatCompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [chat_choice(i, outputs) for i, outputs in enumerate(choices)]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
