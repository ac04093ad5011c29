"""POST /v1/chat/completions: messages in, chat.completion objects (or chunks) out."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
from tokenizer_manager.api.tool_parser import ParsedToolCall, ToolCallStream, parse_tool_calls
from tokenizer_manager.protocol import (
    CHAT_REFUSED,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    new_id,
)
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
        **({"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}),
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


def parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """tool_choice "auto" (the default when tools are given): calls in the output are parsed."""
    return bool(req.tools) and req.tool_choice in (None, "auto")


def tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    body = {
        "id": new_id("call"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return body if index is None else {"index": index, **body}


class ChatStream:
    """A chat request's chunks: the role first, then content (and tool-call) deltas, then usage
    if asked. With tool parsing, each call goes out whole in one delta once its block closes."""

    def __init__(
        self, envelope: Envelope, usage: tuple[bool, bool], tools: ToolUse | None = None
    ) -> None:
        self.envelope = envelope
        self.include_usage, self.continuous_usage = usage
        self.tools = tools
        self.parser = ToolCallStream() if tools else None

    def opening(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope.wrap([choice], None, chunk=True)]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        delta = self.delta(out.text, reason is not None)
        if reason is not None and self.parser is not None and self.parser.calls:
            reason = "tool_calls"
        if not delta and reason is None:
            return []
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        usage = [out] if self.continuous_usage else None
        return [self.envelope.wrap([choice], usage, chunk=True)]

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        if self.parser is None:
            return {"content": text} if text else {}
        content = self.parser.feed(text) + (self.parser.finish() if last else "")
        fresh = self.parser.new_calls()
        first = len(self.parser.calls) - len(fresh)
        calls = [
            tool_call_json(c, first + k)
            for k, c in enumerate(fresh)
            if self.tools.parallel or first + k == 0
        ]
        out: dict[str, Any] = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = calls
        return out

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]:
        return [self.envelope.wrap([], lasts, chunk=True)] if self.include_usage else []


@dataclass(frozen=True)
class ToolUse:
    """How a request's output is searched for tool calls."""

    parallel: bool = True  # parallel_tool_calls: false keeps the first call only


def chat_choice(index: int, outputs: list[StrOutput], tools: ToolUse | None) -> dict[str, Any]:
    text = "".join(o.text for o in outputs)
    reason = finish_reason(outputs[-1])
    content, calls = parse_tool_calls(text) if tools else (text, [])
    calls = calls if tools is None or tools.parallel else calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [tool_call_json(c) for c in calls],
        }
        reason = "tool_calls"
    return {"index": index, "message": message, "finish_reason": reason}


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    if not parses_tool_calls(req):
        return None
    return ToolUse(parallel=req.parallel_tool_calls is not False)


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    objects = ("chat.completion", "chat.completion.chunk")
    id_prefix = "chatcmpl"

    def to_input(self, req: ChatCompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, CHAT_REFUSED)
        check_unknown_message_fields(self, req)
        refuse_fields(req, CHAT_REFUSED)
        self.check_tools(req)
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

    def check_tools(self, req: ChatCompletionRequest) -> None:
        """Tools the chat template would drop are a 400, not ignored."""
        if req.tools and "tools" not in self.tm.chat_template:
            raise APIError("this model's chat template does not render tools", param="tools")

    def sampling(
        self, req: ChatCompletionRequest, cap: int | None, room: int, engine: dict[str, Any]
    ) -> SamplingParams:
        """A chat request's sampling fields as SamplingParams."""
        return openai_sampling(req, cap, room, self.ctx.defaults, engine)

    def stream_writer(self, rid: str, req: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self.envelope(rid), stream_usage(req), tool_use(req))

    def response(
        self, rid: str, req: ChatCompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [chat_choice(i, outputs, tool_use(req)) for i, outputs in enumerate(choices)]
        return self.envelope(rid).wrap(built, [c[-1] for c in choices], chunk=False)
