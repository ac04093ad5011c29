"""POST /v1/chat/completions: messages in, chat.completion objects (or chunks) out."""

from __future__ import annotations

import json
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
from tokenizer_manager.protocol import CHAT_REFUSED, APIError, ChatCompletionRequest, ChatMessage
from tokenizer_manager.tokenizer_manager import GenerateInput

# apply_chat_template's own parameters: not for the template's kwargs
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the chat template is rendered with besides the messages (vLLM's merge order: the
    request's fields, then its chat_template_kwargs)."""
    extra = req.chat_template_kwargs or {}
    for key in extra:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(
                f"chat_template_kwargs cannot set {key}", param=f"chat_template_kwargs.{key}"
            )
    kwargs = {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        **({"documents": req.documents} if req.documents else {}),
        **extra,
    }
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise APIError(
            "continue_final_message needs add_generation_prompt false",
            param="continue_final_message",
        )
    return kwargs


def hf_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as transformers' chat templates take it: unknown keys dropped, tool-call
    arguments as objects (OpenAI sends them as JSON text)."""
    out = message.model_dump(exclude_none=True, exclude=set(message.model_extra or {}))
    for call in out.get("tool_calls", []):
        try:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        except ValueError as e:
            param = f"messages.{index}.tool_calls"
            raise APIError("tool call arguments must be JSON", param=param) from e
    return out


def check_unknown_message_fields(serving: ChatServing, req: ChatCompletionRequest) -> None:
    for message in req.messages:
        serving.ctx.unknown.check(message, (), "messages.")
        for part in message.content if isinstance(message.content, list) else []:
            serving.ctx.unknown.check(part, (), "messages.content.")


class ChatStream:
    """A chat request's chunks: the role first, then content deltas, then usage if asked."""

    def __init__(self, envelope: Envelope, usage: tuple[bool, bool]) -> None:
        self.envelope = envelope
        self.include_usage, self.continuous_usage = usage

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope.wrap([choice], None, chunk=True)]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        if not out.text and reason is None:
            return []
        delta = {"content": out.text} if out.text else {}
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        usage = [out] if self.continuous_usage else None
        return [self.envelope.wrap([choice], usage, chunk=True)]

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


def chat_choice(index: int, outputs: list[StrOutput]) -> dict[str, Any]:
    message = {"role": "assistant", "content": "".join(o.text for o in outputs)}
    return {"index": index, "message": message, "finish_reason": finish_reason(outputs[-1])}


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    objects = ("chat.completion", "chat.completion.chunk")
    id_prefix = "chatcmpl"

    def to_input(self, req: ChatCompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, CHAT_REFUSED)
        check_unknown_message_fields(self, req)
        refuse_fields(req, CHAT_REFUSED)
        engine = engine_values(req, self.ctx.defaults)
        cap = req.max_completion_tokens or req.max_tokens
        return GenerateInput(
            self.request_id(req),
            req.stream,
            lambda room: self.sampling(req, cap, room, engine),
            cap,
            messages=[hf_message(i, m) for i, m in enumerate(req.messages)],
            template_kwargs=template_kwargs(req),
        )

    def sampling(
        self, req: ChatCompletionRequest, cap: int | None, room: int, engine: dict[str, Any]
    ) -> SamplingParams:
        """A chat request's sampling fields as SamplingParams."""
        return openai_sampling(req, cap, room, self.ctx.defaults, engine)

    def stream_writer(self, rid: str, req: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self.envelope(rid), stream_usage(req))

    def response(
        self, rid: str, req: ChatCompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [chat_choice(i, outputs) for i, outputs in enumerate(choices)]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
