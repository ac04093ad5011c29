"""POST /v1/chat/completions: messages in, chat.completion objects (or chunks) out."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from runtime.grammar import ThinkSection
from runtime.io_struct import StrOutput
from runtime.sampling_params import SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.fields import refuse_fields, unsupported
from tokenizer_manager.api.logprobs import chat_logprobs
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    OpenAIStream,
    engine_values,
    openai_sampling,
    stream_usage,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.api.reasoning_parser import (
    ReasoningStream,
    split_reasoning,
    think_section,
)
from tokenizer_manager.api.structured import OPENAI_READERS
from tokenizer_manager.api.tool_choice import forced_tools, tool_call_grammar
from tokenizer_manager.api.tool_parser import ParsedToolCall, ToolCallStream, parse_tool_calls
from tokenizer_manager.protocol import (
    CHAT_REFUSED,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    TokenizeRequest,
    Tool,
    new_id,
)
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager

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


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
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


def check_template_inputs(
    tm: TokenizerManager, tools: list[Tool] | None, documents: list | None
) -> None:
    """Tools or documents the chat template would drop are a 400, not ignored."""
    for name, value in (("tools", tools), ("documents", documents)):
        if value and name not in tm.chat_template:
            raise APIError(f"this model's chat template does not render {name}", param=name)


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
            for url in (part.image_url, part.video_url):
                if url is not None:
                    serving.ctx.unknown.check(url, (), f"messages.content.{part.type}.")


@dataclass(frozen=True)
class ReplyShape:
    """How a reply's text is split: its thinking section (a --reasoning-parser rule, when the
    request separates reasoning) and its tool calls (tools with any tool_choice but "none")."""

    reasoning: str | None = None
    include_reasoning: bool = True
    stream_reasoning: bool = True  # false: a stream sends the thinking once its section closes
    tools: bool = False
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only


def reply_shape(req: ChatCompletionRequest, rule: str | None) -> ReplyShape:
    return ReplyShape(
        reasoning=rule if req.separate_reasoning else None,
        include_reasoning=req.include_reasoning,
        stream_reasoning=req.stream_reasoning,
        tools=bool(req.tools) and req.tool_choice != "none",
        parallel=req.parallel_tool_calls is not False,
    )


def tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    body = {
        "id": new_id("call"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return body if index is None else {"index": index, **body}


class ReplySplitter:
    """One streamed reply's deltas: thinking, content and whole tool calls as they close."""

    def __init__(self, shape: ReplyShape) -> None:
        self.shape = shape
        self.thinking = ReasoningStream(shape.reasoning) if shape.reasoning else None
        self.tools = ToolCallStream() if shape.tools else None
        self.held = ""  # thinking not sent yet (stream_reasoning false)

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def delta(self, text: str, last: bool) -> dict[str, Any]:
        reasoning, content = "", text
        if self.thinking is not None:
            reasoning, content = pair_sum(self.thinking.feed(text), self.thinking, last)
            reasoning = self.pace(reasoning, last)
        out: dict[str, Any] = {}
        if reasoning and self.shape.include_reasoning:
            out["reasoning_content"] = reasoning
        if self.tools is not None:
            content = self.tools.feed(content) + (self.tools.finish() if last else "")
            out |= self.call_deltas()
        return ({"content": content} if content else {}) | out

    def pace(self, reasoning: str, last: bool) -> str:
        """The thinking to send now: as it comes, or (stream_reasoning false) all of it in one
        delta once its section closes."""
        if self.shape.stream_reasoning:
            return reasoning
        self.held += reasoning
        if not (last or self.thinking.over):
            return ""
        out, self.held = self.held, ""
        return out

    def call_deltas(self) -> dict[str, Any]:
        fresh = self.tools.new_calls()
        first = len(self.tools.calls) - len(fresh)
        calls = [
            tool_call_json(c, first + k)
            for k, c in enumerate(fresh)
            if self.shape.parallel or first + k == 0
        ]
        return {"tool_calls": calls} if calls else {}


def pair_sum(got: tuple[str, str], stream: ReasoningStream, last: bool) -> tuple[str, str]:
    if not last:
        return got
    rest = stream.finish()
    return got[0] + rest[0], got[1] + rest[1]


class ChatStream(OpenAIStream):
    """A chat request's chunks: the role first, then content, reasoning and tool-call deltas,
    then usage if asked. Each tool call goes out whole in one delta once its block closes."""

    def __init__(
        self,
        envelope: Envelope,
        usage: tuple[bool, bool],
        shape: ReplyShape = ReplyShape(),
        n: int = 1,
    ) -> None:
        super().__init__(envelope, usage)
        self.shape = shape
        self.n = n
        self.splitters: dict[int, ReplySplitter] = {}  # one per choice

    def opening(self, firsts: list[StrOutput]) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        choices = [{"index": i, "delta": delta, "finish_reason": None} for i in range(self.n)]
        return [self.chunk(choice, firsts[0], completion_tokens=0) for choice in choices]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        splitter = self.splitters.setdefault(index, ReplySplitter(self.shape))
        delta = splitter.delta(out.text, reason is not None)
        if reason is not None and splitter.called:
            reason = "tool_calls"
        if not delta and reason is None and not out.logprobs:
            return []
        choice = {"index": index, "delta": delta, "finish_reason": reason}
        if out.logprobs is not None:
            choice["logprobs"] = chat_logprobs([out])
        return [self.chunk(choice, out)]


def chat_message(shape: ReplyShape, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole reply, and whether it called tools."""
    reasoning = None
    if shape.reasoning:
        reasoning, text = split_reasoning(shape.reasoning, text)
    content, calls = parse_tool_calls(text) if shape.tools else (text, [])
    calls = calls if shape.parallel else calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    if reasoning is not None and shape.include_reasoning:
        message["reasoning_content"] = reasoning
    return message, bool(calls)


def chat_choice(index: int, outputs: list[StrOutput], shape: ReplyShape) -> dict[str, Any]:
    message, called = chat_message(shape, "".join(o.text for o in outputs))
    reason = "tool_calls" if called else finish_reason(outputs[-1])
    logprobs = chat_logprobs(outputs)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def add_tool_grammar(req: ChatCompletionRequest, engine: dict[str, Any]) -> None:
    """tool_choice required or named: the reply must be tool calls (a grammar, so no other
    structured-output constraint may come with it)."""
    forced = forced_tools(req.tools, req.tool_choice)
    if forced is None:
        return
    if "grammar" in engine:
        message = "tool_choice required or named cannot be combined with response_format"
        raise APIError(message, param="tool_choice")
    engine["grammar"] = tool_call_grammar(forced, req.parallel_tool_calls is not False)


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """`token`'s id when the vocabulary holds it as one token, else None."""
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or tokenizer.convert_ids_to_tokens(found) != token:
        return None
    return found


def check_top_logprobs(req: ChatCompletionRequest) -> None:
    """top_logprobs asks for alternatives of the logprobs it needs (OpenAI's rule)."""
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    objects = ("chat.completion", "chat.completion.chunk")
    id_prefix = "chatcmpl"

    def to_input(self, req: ChatCompletionRequest) -> GenerateInput:
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, CHAT_REFUSED.keys() | OPENAI_READERS.keys())
        check_unknown_message_fields(self, req)
        refuse_fields(req, CHAT_REFUSED)
        check_template_inputs(self.tm, req.tools, req.documents)
        self.check_reasoning(req)
        check_top_logprobs(req)
        engine = engine_values(req, self.ctx.defaults) | {
            "logprobs": (req.top_logprobs or 0) if req.logprobs else None,
            "n": req.n,
        }
        add_tool_grammar(req, engine)
        self.constrain_after_thinking(engine)
        cap = req.max_completion_tokens or req.max_tokens
        return GenerateInput(
            self.request_id(req),
            req.stream,
            lambda room: self.sampling(req, cap, room, engine),
            cap,
            req.n,
            messages=[hf_message(i, m) for i, m in enumerate(req.messages)],
            template_kwargs=template_kwargs(req),
            mm_processor_kwargs=req.mm_processor_kwargs,
        )

    def shape(self, req: ChatCompletionRequest) -> ReplyShape:
        return reply_shape(req, self.ctx.reasoning_parser)

    def constrain_after_thinking(self, engine: dict[str, Any]) -> None:
        """With a reasoning parser the model thinks freely and the constraint binds what follows
        `</think>`, as SGLang does; a vocabulary without single think tokens cannot tell where
        that is (refused)."""
        spec = engine.get("grammar")
        if spec is None or self.ctx.reasoning_parser is None:
            return
        if self.think_tokens is None:
            reason = "the tokenizer has no single <think> / </think> tokens for --reasoning-parser"
            raise unsupported(spec.param or "response_format", reason)
        engine["grammar"] = dataclasses.replace(spec, think=self.think_tokens)

    @cached_property
    def think_tokens(self) -> ThinkSection | None:
        assert self.ctx.reasoning_parser is not None
        tokenizer = self.tm.tokenizer
        return think_section(self.ctx.reasoning_parser, lambda t: single_token_id(tokenizer, t))

    def check_reasoning(self, req: ChatCompletionRequest) -> None:
        """Without a reasoning parser the thinking stays in the content: it cannot be left out."""
        if not req.include_reasoning and self.ctx.reasoning_parser is None:
            raise unsupported("include_reasoning", "no --reasoning-parser is configured")

    def sampling(
        self, req: ChatCompletionRequest, cap: int | None, room: int, engine: dict[str, Any]
    ) -> SamplingParams:
        """A chat request's sampling fields as SamplingParams."""
        return openai_sampling(req, cap, room, self.ctx.defaults, engine)

    def stream_writer(self, rid: str, req: ChatCompletionRequest) -> ChatStream:
        return ChatStream(self.envelope(rid), stream_usage(req), self.shape(req), req.n)

    def response(
        self, rid: str, req: ChatCompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        built = [chat_choice(i, outputs, self.shape(req)) for i, outputs in enumerate(choices)]
        return self.envelope(rid).whole(built, [c[-1] for c in choices])
