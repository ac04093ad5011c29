"""The API layer on its own (a fake TokenizerManager): what each API turns a request into and how
its outputs come back, streamed or not."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from runtime.grammar import GrammarSpec
from runtime.io_struct import Finish, FinishKind, StrOutput, TokenizedGenerateReq
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import save_generation_config
from tokenizer_manager.api.chat import ChatStream
from tokenizer_manager.api.fields import sampler_has
from tokenizer_manager.api.openai_common import ENGINE_FIELDS, Envelope
from tokenizer_manager.http.server import create_app
from tokenizer_manager.metrics import ServingMetrics
from tokenizer_manager.protocol import CHAT_REFUSED, COMPLETION_REFUSED
from tokenizer_manager.tokenizer_manager import GenerateInput


class FakeManager(SimpleNamespace):
    """Takes every request, records its GenerateInput and answers "ok" then "!" (2 tokens), or
    the pieces of `reply`, one token each."""

    def __init__(self, reply: tuple[str, ...] = ("ok", "!"), **args: Any) -> None:
        super().__init__(
            args=ServerArgs(model_path="/models/demo", **args),
            context_length=128,
            healthy=lambda: True,
            metrics=ServingMetrics(),
            chat_template="{{ messages }} {{ tools }}",
            seen=[],
            params=[],
            reply=reply,
        )

    async def tokenize_request(self, inp: GenerateInput) -> TokenizedGenerateReq:
        self.seen.append(inp)
        params = inp.sampling(100)
        self.params.append(params)
        return TokenizedGenerateReq(inp.rid, [1, 2, 3], params, None, inp.stream)

    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None, route: object = None
    ) -> AsyncIterator[StrOutput]:
        for i, text in enumerate(self.reply):
            last = i == len(self.reply) - 1
            finish = Finish(FinishKind.STOP) if last else None
            yield StrOutput(req.rid, text, [7 + i], 3, i + 1, int(last), finish)


@pytest.fixture
def fake() -> FakeManager:
    return FakeManager()


@pytest.fixture
def http(fake: FakeManager) -> TestClient:
    return TestClient(create_app(fake))


ENGINE_CASES = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_tokens": 3,
    "logit_bias": {"17": -100},
    "allowed_token_ids": [3, 4],
    "bad_words": ["no"],
    "include_stop_str_in_output": True,
    "no_stop_trim": True,
}
ENGINE_EXPECTED = {"logit_bias": {17: -100.0}}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
NATIVE = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


def counters(http: TestClient) -> dict[str, int]:
    return dict(vars(http.app.state.counters))


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"}), ("/generate", NATIVE)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_every_route_records_usage_once(
    http: TestClient, path: str, body: dict, stream: bool
) -> None:
    """Streamed or not, every API counts the finished request's tokens (the native stream did
    not)."""
    resp = http.post(path, json={**body, "stream": stream})
    assert resp.status_code == 200
    got = counters(http)
    assert (got["prompt_tokens"], got["completion_tokens"], got["cached_tokens"]) == (3, 2, 1)


# ---------------------------------------------------------------------- nothing silently ignored

ASKING = {  # a value that asks for something, where 2 is not one
    "logprobs": True,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "response_format": {"type": "json_object"},
    "echo": True,
    "tool_choice": "required",
}


@pytest.mark.parametrize(
    ("path", "base", "table"),
    [
        ("/v1/chat/completions", CHAT, CHAT_REFUSED),
        ("/v1/completions", {"prompt": "hi"}, COMPLETION_REFUSED),
    ],
)
def test_every_refused_field_is_a_400_naming_it(
    fake: FakeManager, http: TestClient, path: str, base: dict, table: dict
) -> None:
    for name in table:
        resp = http.post(path, json={**base, name: ASKING.get(name, 2)})
        assert resp.status_code == 400, (name, resp.text)
        err = resp.json()["error"]
        assert err["param"] == name and name in err["message"], err
    assert fake.seen == []


@pytest.mark.parametrize("name", ["n", "best_of", "service_tier", "modalities", "top_logprobs"])
def test_values_that_ask_for_nothing_are_accepted(http: TestClient, name: str) -> None:
    inert = {"n": 1, "best_of": 1, "service_tier": "auto", "modalities": ["text"]}
    resp = http.post("/v1/chat/completions", json={**CHAT, name: inert.get(name, 0)})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("name", "value"), [(k, v) for k, v in ENGINE_CASES.items()])
def test_engine_fields_reach_sampling_params_or_are_refused(
    fake: FakeManager, http: TestClient, name: str, value: object
) -> None:
    """Each engine field lands on its SamplingParams attribute; while the sampler lacks that
    attribute the field is a 400 naming it (never accepted and dropped)."""
    attribute, expected = ENGINE_FIELDS[name][0], ENGINE_EXPECTED.get(name, value)
    resp = http.post("/v1/completions", json={"prompt": "hi", name: value})
    if sampler_has(attribute):
        assert resp.status_code == 200, resp.text
        assert getattr(fake.params[0], attribute) == expected
    else:
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name


def test_unknown_fields_are_ignored_with_one_warning_per_name(
    http: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:,", "max_dynamic_patch": 4}}
    messages = [{"role": "user", "content": [part], "mood": 2}]
    body = {**CHAT, "frobnicate": 1, "messages": messages}
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert len(warned) == 3
    assert "'frobnicate'" in warned[0] and "'messages.mood'" in warned[1]
    assert "'messages.content.image_url.max_dynamic_patch'" in warned[2]


USER = {"role": "user", "content": "x"}
IMAGE_NO_URL = {"type": "image_url"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": [{"role": "system"}, USER]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [IMAGE_NO_URL]}]}, "messages.0.content"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": False, "stream_options": {}}, "stream_options"),
        ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({**CHAT, "continue_final_message": True}, "continue_final_message"),
        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_malformed_chat_requests_are_400s(
    fake: FakeManager, http: TestClient, body: dict, param: str
) -> None:
    """The three that were 200s (a null user message, a text part without text,
    stream_options without stream) and their neighbours."""
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert fake.seen == []


def test_an_assistant_turn_may_leave_content_null(fake: FakeManager, http: TestClient) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    assert http.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    sent = fake.seen[0].messages
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert sent[2]["tool_call_id"] == "c1"


def test_template_options_and_request_ids_are_honoured(fake: FakeManager, http: TestClient) -> None:
    body = {
        **CHAT,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "request_id": "abc",
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.json()["id"] == "chatcmpl-abc"
    assert fake.seen[0].template_kwargs == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "enable_thinking": False,
    }
    assert http.post("/v1/completions", json={"prompt": "x", "rid": "r9"}).json()["id"] == (
        "cmpl-r9"
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_stop_token_ids_on_every_route(fake: FakeManager, http: TestClient, path: str) -> None:
    body = {
        "/v1/chat/completions": {**CHAT, "stop_token_ids": [5, 9]},
        "/v1/completions": {"prompt": "hi", "stop_token_ids": [5, 9]},
        "/generate": {"text": "hi", "sampling_params": {"stop_token_ids": [5, 9]}},
    }[path]
    assert http.post(path, json=body).status_code == 200
    assert fake.params[0].stop_token_ids == [5, 9]


def test_max_completion_tokens_wins_over_max_tokens(fake: FakeManager, http: TestClient) -> None:
    body = {**CHAT, "max_tokens": 9, "max_completion_tokens": 4}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert fake.params[0].max_new_tokens == 4 and fake.seen[0].max_tokens == 4


CONTINUOUS = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "echo": True})],
)
def test_continuous_usage_stats_puts_usage_in_every_chunk(
    http: TestClient, path: str, body: dict
) -> None:
    """The opening chunk (chat's role, completions' echo) included: the prompt, no tokens yet."""
    events = sse_events(http.post(path, json={**body, **CONTINUOUS}))
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 2]  # last: the total
    assert {e["usage"]["prompt_tokens"] for e in events} == {3}
    assert events[0]["usage"]["total_tokens"] == 3


def test_continuous_usage_counts_the_prompt_for_every_choice() -> None:
    stream = ChatStream(Envelope("r", "m", "chat.completion", "chunk"), (False, True), n=2)
    first = StrOutput("r", "a", [7], 3, 1, 1, index=1)
    opening = [e["usage"] for e in stream.opening([first])]
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in opening] == [(3, 0), (3, 0)]
    (chunk,) = stream.chunks(first, 1)
    assert (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]) == (3, 1)


def test_native_sampling_names(fake: FakeManager, http: TestClient) -> None:
    body = {"text": "hi", "sampling_params": {"sampling_seed": 7, "max_new_tokens": 3}}
    assert http.post("/generate", json=body).status_code == 200
    assert fake.params[0].seed == 7
    constrained = {"text": "hi", "sampling_params": {"regex": "a+"}}
    assert http.post("/generate", json=constrained).status_code == 200
    assert fake.params[1].grammar == GrammarSpec("regex", "a+")
    bad = {"text": "hi", "sampling_params": {"custom_params": {"a": 1}}}
    resp = http.post("/generate", json=bad)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "sampling_params.custom_params"


def sse_events(resp: Any) -> list[dict]:
    lines = [line for line in resp.text.split("\n\n") if line.startswith("data: {")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_native_engine_fields_use_sglang_names(fake: FakeManager, http: TestClient) -> None:
    body = {"text": "hi", "sampling_params": {"min_new_tokens": 2}}
    resp = http.post("/generate", json=body)
    if sampler_has("min_tokens"):
        assert resp.status_code == 200 and fake.params[0].min_tokens == 2
    else:
        assert resp.json()["error"]["param"] == "sampling_params.min_new_tokens"


def test_checkpoint_defaults_fill_only_what_the_request_leaves_unset(tmp_path: Path) -> None:
    save_generation_config(tmp_path, {"do_sample": True, "top_k": 1, "max_new_tokens": 7})
    fake = FakeManager()
    fake.args = ServerArgs(model_path=str(tmp_path))
    http = TestClient(create_app(fake))
    http.post("/v1/chat/completions", json=CHAT)
    http.post("/v1/chat/completions", json={**CHAT, "top_k": 5, "max_tokens": 3})
    http.post("/generate", json={"text": "hi"})
    got = [(p.top_k, p.max_new_tokens, p.temperature) for p in fake.params]
    assert got == [(1, 7, 1.0), (5, 3, 1.0), (1, 7, 1.0)]
    off = FakeManager()
    off.args = ServerArgs(model_path=str(tmp_path), generation_config="vllm")
    TestClient(create_app(off)).post("/v1/chat/completions", json=CHAT)
    assert (off.params[0].top_k, off.params[0].max_new_tokens) == (-1, 100)
