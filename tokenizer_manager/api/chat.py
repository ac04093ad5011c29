"""POST /v1/chat/completions: messages in, chat.completion objects (or chunks) out."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampler import SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    common_refusals,
    include_usage,
    openai_sampling,
    refuse,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.protocol import ChatCompletionRequest, new_id
from tokenizer_manager.tokenizer_manager import GenerateInput


def chat_sampling(req: ChatCompletionRequest, room: int) -> SamplingParams:
    """A chat request's sampling fields as SamplingParams."""
    return openai_sampling(req, req.max_completion_tokens or req.max_tokens, room)


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    fmt = (req.response_format or {}).get("type", "text")
    refuse(
        common_refusals(req)
        + [
            (bool(req.tools), "tools", "tools are not supported"),
            (fmt != "text", "response_format", "only text responses are supported"),
        ]
    )


class ChatStream:
    """A chat request's chunks: the role first, then content deltas, then usage if asked."""

    def __init__(self, envelope: Envelope, include_usage: bool) -> None:
        self.envelope = envelope
        self.include_usage = include_usage

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope.wrap([choice], None, chunk=True)]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        if not out.text and reason is None:
            return []
        delta = {"content": out.text} if out.text else {}
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        return [self.envelope.wrap([choice], None, chunk=True)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


def chat_choice(index: int, outputs: list[StrOutput]) -> dict[str, Any]:
    message = {"role": "assistant", "content": "".join(o.text for o in outputs)}
    return {"index": index, "message": message, "finish_reason": finish_reason(outputs[-1])}


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
        return ChatStream(self.envelope(rid), include_usage(req))

    def response(
        self, rid: str, req: ChatCompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [chat_choice(i, outputs) for i, outputs in enumerate(choices)]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
