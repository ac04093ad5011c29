"""Tools: rendered by the chat template as transformers renders them, calls in the output parsed
into `message.tool_calls` / tool-call deltas, checked with the official openai client against a
fake output stream (the tiny model's random text never makes a call)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from test_api_layer import FakeManager, sse_events
from think_tokens import THINK_TOKENS
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from runtime.grammar import ThinkSection
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import build_tokenizer, make_checkpoint
from tokenizer_manager.api.base import ApiContext
from tokenizer_manager.api.chat import ChatServing
from tokenizer_manager.api.usage import ApiCounters, UsageRecorder
from tokenizer_manager.front_end import build_front_end
from tokenizer_manager.http.server import create_app
from tokenizer_manager.protocol import ChatCompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client(reply: tuple[str, ...]) -> tuple[OpenAI, FakeManager]:
    fake = FakeManager(reply)
    http = TestClient(create_app(fake), base_url="http://tessera")
    return OpenAI(base_url="http://tessera/v1", api_key="x", http_client=http), fake


def test_a_call_comes_back_as_tool_calls() -> None:
    api, fake = client(("Let me check.\n", CALL[:30], CALL[30:]))
    out = api.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert fake.seen[0].template_kwargs["tools"] == [WEATHER]


def test_a_streamed_call_comes_as_tool_call_deltas() -> None:
    pieces = ("Let me ", "check.\n<tool", "_call>", CALL[11:40], CALL[40:], "\n", CALL)
    api, _ = client(pieces)
    stream = api.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], stream=True)
    content, calls, reasons = [], {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(content) == "Let me check.\n\n"
    assert calls == {0: ("weather", {"city": "Paris"}), 1: ("weather", {"city": "Paris"})}
    assert reasons[-1] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    api, _ = client((CALL + CALL,))
    out = api.chat.completions.create(
        model="demo", messages=ASK, tools=[WEATHER], parallel_tool_calls=False
    )
    assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["none", None])
def test_without_auto_or_tools_the_text_is_content(choice: str | None) -> None:
    api, _ = client((CALL,))
    kw = {"tools": [WEATHER], "tool_choice": choice} if choice else {}
    out = api.chat.completions.create(model="demo", messages=ASK, **kw)
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_tools_and_documents_the_template_would_drop_are_refused() -> None:
    fake = FakeManager()
    fake.chat_template = "{{ messages }}"
    http = TestClient(create_app(fake))
    for name, value in (("tools", [WEATHER]), ("documents", [{"title": "a", "text": "b"}])):
        resp = http.post("/v1/chat/completions", json={"messages": ASK, name: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name


# ---------------------------------------------------------------------- the template, as HF

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tools_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("tools") / "ckpt")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TOOLS_TEMPLATE}))
    return folder


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "content": "21 C, sunny", "tool_call_id": "c1"},
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_prompt_tokens_equal_hf_apply_chat_template(tools_checkpoint: Path, kwargs: dict) -> None:
    """The request's tools, tool calls (arguments sent as JSON text), tool messages and template
    kwargs give the prompt transformers' apply_chat_template gives (arguments as objects)."""
    tm = build_front_end(ServerArgs(model_path=str(tools_checkpoint)), media=None).tm
    serving = ChatServing(tm, ApiContext(UsageRecorder(ApiCounters())))
    body = {"messages": CONVERSATION, "tools": [WEATHER], "chat_template_kwargs": kwargs}
    inp = serving.to_input(ChatCompletionRequest.model_validate(body))
    prompt, _ = tm.render_chat(inp.messages, inp.template_kwargs)
    hf_messages = json.loads(json.dumps(CONVERSATION))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf_messages[1]["content"] = ""
    expected = tm.tokenizer.apply_chat_template(
        hf_messages,
        tools=[WEATHER],
        chat_template=TOOLS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    assert tm.encode(prompt) == list(expected)
    assert "<tools>" in prompt and '"arguments": {"city": "Paris"}' in prompt
    asyncio.run(tm.close())


# ---------------------------------------------------------------------- reasoning

THOUGHT = ("<think>\nParis is ", "in France.\n</th", "ink>\n\n", "It is sunny.")


def thinking_server(**args: object) -> TestClient:
    return TestClient(create_app(FakeManager(THOUGHT, **args)))


def test_the_reasoning_parser_splits_the_thinking_section() -> None:
    http = thinking_server(reasoning_parser="qwen3")
    message = http.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]
    assert message["message"]["reasoning_content"] == "\nParis is in France.\n"
    assert message["message"]["content"] == "\n\nIt is sunny."
    body = {"messages": ASK, "include_reasoning": False}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "\n\nIt is sunny."


def test_streamed_reasoning_comes_as_reasoning_deltas() -> None:
    http = thinking_server(reasoning_parser="qwen3")
    resp = http.post("/v1/chat/completions", json={"messages": ASK, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(resp)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nParis is in France.\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nIt is sunny."


def test_without_a_parser_thinking_stays_content_and_cannot_be_dropped() -> None:
    http = thinking_server()
    message = http.post("/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]
    assert message["message"]["content"] == "".join(THOUGHT)
    body = {"messages": ASK, "include_reasoning": False}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "include_reasoning"


def tiny_tokenizer(think: bool) -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    if think:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_constraint_with_a_reasoning_parser_starts_after_the_thinking_section() -> None:
    """The constraint carries the think tokens to the scheduler (which applies it after
    </think>); a vocabulary without them cannot say where that is: a 400 naming the field."""
    for rule, start in (("qwen3", True), ("deepseek_r1", False)):
        fake = FakeManager(THOUGHT, reasoning_parser=rule)
        fake.tokenizer = tiny_tokenizer(think=True)
        http = TestClient(create_app(fake))
        body = {"messages": ASK, "response_format": {"type": "json_object"}}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        end_id, start_id = fake.tokenizer.convert_tokens_to_ids(["</think>", "<think>"])
        think = fake.params[-1].grammar.think
        assert think == ThinkSection(end_id, start_id if start else None)
    fake = FakeManager(THOUGHT, reasoning_parser="qwen3")
    fake.tokenizer = tiny_tokenizer(think=False)
    http = TestClient(create_app(fake))
    for field, value in (("response_format", {"type": "json_object"}), ("tool_choice", "required")):
        body = {"messages": ASK, "tools": [WEATHER], field: value}
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
        assert "<think>" in resp.json()["error"]["message"]
