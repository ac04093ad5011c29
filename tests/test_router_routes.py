"""What sglang-router asks of a worker, on the API layer alone (a fake TokenizerManager): the
identity, load and health routes, and the fields it adds to every body, exactly as it sends them
(captured from sglang-router 0.3.2), honoured at their defaults and refused otherwise. The router
itself in front of two servers: tests/test_router.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_api_layer import FakeManager, sse_events

from runtime.io_struct import Finish, ServerInfo, StrOutput, TokenizedGenerateReq
from tokenizer_manager.http.server import create_app

# sglang-router's bodies for a client's {"messages": [...], "max_tokens": 3} and
# {"text": "hi", "sampling_params": {"max_new_tokens": 3}}; its --dp-aware mode adds
# "data_parallel_rank": 0 to the chat body
ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "unknown",
    "logprobs": False,
    "max_completion_tokens": 3,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_GENERATE = {
    "text": "hi",
    "model": None,
    "sampling_params": {"max_new_tokens": 3},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
ROUTER_COMPLETION = {
    "model": "demo",
    "prompt": "hi",
    "max_tokens": 3,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
INFO = ServerInfo(kv_total=100, kv_free=60, kv_evictable=25, kv_protected=0, running=2, waiting=1)
IDLE = ServerInfo(100, 90, 10, 0, running=0, waiting=0, replica=1)


class WorkerManager(FakeManager):
    """FakeManager with the scheduler's ServerInfo and a checkpoint config."""

    def __init__(self, reply: tuple[str, ...] = ("ok", "!"), **args: Any) -> None:
        super().__init__(reply, **args)
        self.config = SimpleNamespace(raw={"model_type": "qwen2_vl", "architectures": ["X"]})
        self.grammar = SimpleNamespace(info=lambda: {})
        self.states: dict = {}

    async def server_infos(self) -> list[ServerInfo]:
        return [INFO, IDLE]  # two replicas (--dp 2): one busy, one idle

    def replicas_info(self, infos: list[ServerInfo]) -> list[dict]:
        return [{"replica": info.replica} for info in infos]

    def media_info(self) -> None:
        return None


class SilentManager(WorkerManager):
    """Its model never answers; records that the request was closed (aborted)."""

    closed = 0

    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None
    ) -> AsyncIterator[StrOutput]:
        try:
            await asyncio.Event().wait()
            yield StrOutput(req.rid, "", [], 3, 0, 0, None)
        finally:
            self.closed += 1


class FailingManager(WorkerManager):
    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None
    ) -> AsyncIterator[StrOutput]:
        yield StrOutput(req.rid, "", [], 3, 0, 0, Finish.error("the device fell over"))


def client(manager: FakeManager) -> TestClient:
    return TestClient(create_app(manager))


@pytest.fixture
def fake() -> WorkerManager:
    return WorkerManager(dp_size=2)


@pytest.fixture
def http(fake: WorkerManager) -> TestClient:
    return client(fake)


def test_the_router_bodies_are_served(fake: WorkerManager, http: TestClient) -> None:
    """Its chat (naming the model "unknown" when the client named none), completion and native
    bodies are 200s, their defaults asking for nothing more than the plain request does."""
    for path, body in [
        ("/v1/chat/completions", ROUTER_CHAT),
        ("/v1/chat/completions", ROUTER_CHAT | {"data_parallel_rank": 0}),
        ("/v1/chat/completions", ROUTER_CHAT | {"data_parallel_rank": None}),
        ("/v1/completions", ROUTER_COMPLETION),
        ("/generate", ROUTER_GENERATE),
        ("/generate", ROUTER_GENERATE | {"data_parallel_rank": 0, "model": "demo"}),
    ]:
        resp = http.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text)
    assert {p.include_stop_str_in_output for p in fake.params} == {False}
    assert [p.max_new_tokens for p in fake.params][:2] == [3, 3]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "return_hidden_states", True),
        ("/v1/chat/completions", "data_parallel_rank", 2),  # two replicas: 0 and 1
        ("/v1/chat/completions", "model", "another-model"),
        ("/generate", "return_hidden_states", True),
        ("/generate", "data_parallel_rank", 2),
        ("/generate", "log_metrics", False),
        ("/generate", "return_bytes", True),
        ("/generate", "return_entropy", True),
        ("/generate", "background", True),
        ("/generate", "no_logs", True),
        ("/generate", "model", "another-model"),
    ],
)
def test_router_fields_that_ask_for_more_are_refused_naming_them(
    fake: WorkerManager, http: TestClient, path: str, field: str, value: object
) -> None:
    base = ROUTER_CHAT if path == "/v1/chat/completions" else ROUTER_GENERATE
    resp = http.post(path, json=base | {field: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
    assert fake.seen == []


def test_no_stop_trim_keeps_the_stop_string(fake: WorkerManager, http: TestClient) -> None:
    assert http.post("/v1/chat/completions", json=ROUTER_CHAT | {"no_stop_trim": True}).is_success
    assert fake.params[-1].include_stop_str_in_output is True


def test_separate_reasoning_false_leaves_the_thinking_in_the_content() -> None:
    http = client(WorkerManager(("<think>", "hm", "</think>", "yes"), reasoning_parser="qwen3"))
    split = http.post("/v1/chat/completions", json=ROUTER_CHAT).json()["choices"][0]["message"]
    assert (split["reasoning_content"], split["content"]) == ("hm", "yes")
    whole = http.post("/v1/chat/completions", json=ROUTER_CHAT | {"separate_reasoning": False})
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == "<think>hm</think>yes" and "reasoning_content" not in message


def reasoning_deltas(stream_reasoning: bool) -> list[tuple[str, str]]:
    """(reasoning, content) of each streamed delta of a reply that thinks in two pieces."""
    reply = ("<think>", "a", "b", "</think>", "c", "d")
    http = client(WorkerManager(reply, reasoning_parser="qwen3"))
    body = ROUTER_CHAT | {"stream": True, "stream_reasoning": stream_reasoning}
    deltas = [
        e["choices"][0]["delta"] for e in sse_events(http.post("/v1/chat/completions", json=body))
    ]
    pairs = [(d.get("reasoning_content", ""), d.get("content", "")) for d in deltas]
    return [pair for pair in pairs if pair != ("", "")]


def test_stream_reasoning_false_sends_the_thinking_in_one_piece() -> None:
    assert reasoning_deltas(True) == [("a", ""), ("b", ""), ("", "c"), ("", "d")]
    assert reasoning_deltas(False) == [("ab", ""), ("", "c"), ("", "d")]


def test_get_load_reports_the_kv_the_requests_hold(http: TestClient) -> None:
    """One entry per data-parallel rank (replica), as the router parses it; held = total -
    free - evictable."""
    assert http.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 15},
        {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
    ]


def test_model_info_and_server_info_name_the_worker(http: TestClient) -> None:
    info = http.get("/model_info").json()
    assert http.get("/get_model_info").json() == info
    assert info["model_path"] == info["tokenizer_path"] == "/models/demo"
    assert info["is_generation"] and info["has_image_understanding"]
    assert (info["served_model_name"], info["model_type"]) == ("demo", "qwen2_vl")
    server = http.get("/get_server_info").json()
    assert server == http.get("/server_info").json()
    assert server["served_model_name"] == "demo" and server["dp_size"] == 2
    # the scheduler's numbers, as /server_info has them: the replicas' sums
    assert server["kv_free"] == INFO.kv_free + IDLE.kv_free


def test_health_generate_is_200_when_the_model_answers(http: TestClient) -> None:
    assert http.get("/health_generate").status_code == 200


def test_health_generate_is_503_when_the_model_fails() -> None:
    assert client(FailingManager()).get("/health_generate").status_code == 503


def test_health_generate_is_503_past_its_deadline_and_aborts_its_request() -> None:
    silent = SilentManager(health_stall_timeout=0.2)
    assert client(silent).get("/health_generate").status_code == 503
    assert silent.closed == 1
