"""Completions with several prompts (text or token ids) and echo: one choice per prompt, each its
own engine request, usage summed, every request closed when one fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from fastapi.testclient import TestClient
from test_api_layer import FakeManager, sse_events

from runtime.io_struct import Finish, StrOutput, TokenizedGenerateReq
from tokenizer_manager.http.server import create_app


def http_and_fake() -> tuple[TestClient, FakeManager]:
    fake = FakeManager()
    fake.tokenizer = SimpleNamespace(decode=lambda ids: "<" + ",".join(map(str, ids)) + ">")
    return TestClient(create_app(fake)), fake


def test_a_list_of_prompts_gives_one_choice_each() -> None:
    http, fake = http_and_fake()
    out = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "request_id": "x"}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == ["ok!"] * 3
    assert out["id"] == "cmpl-x"
    assert [i.rid for i in fake.seen] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [i.text for i in fake.seen] == ["a", "b", "c"]
    assert out["usage"]["prompt_tokens"] == 9 and out["usage"]["completion_tokens"] == 6
    assert vars(http.app.state.counters)["completion_tokens"] == 6


def test_token_id_prompts_one_or_several() -> None:
    http, fake = http_and_fake()
    assert http.post("/v1/completions", json={"prompt": [5, 6]}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": [[5, 6], [7]]}).status_code == 200
    assert [i.input_ids for i in fake.seen] == [[5, 6], [5, 6], [7]]
    for bad in ([], ["a"] * 65):
        resp = http.post("/v1/completions", json={"prompt": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_streamed_prompts_carry_their_index() -> None:
    http, _ = http_and_fake()
    body = {"prompt": ["a", "b"], "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(http.post("/v1/completions", json=body))
    texts: dict[int, str] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "ok!", 1: "ok!"}
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_echo_prepends_each_prompt() -> None:
    http, _ = http_and_fake()
    out = http.post("/v1/completions", json={"prompt": ["Hi ", "Yo "], "echo": True}).json()
    assert [c["text"] for c in out["choices"]] == ["Hi ok!", "Yo ok!"]
    out = http.post("/v1/completions", json={"prompt": [5, 6], "echo": True}).json()
    assert out["choices"][0]["text"] == "<5,6>ok!"
    body = {"prompt": "Hi ", "echo": True, "stream": True}
    events = sse_events(http.post("/v1/completions", json=body))
    assert "".join(e["choices"][0]["text"] for e in events) == "Hi ok!"


def test_one_failed_prompt_fails_the_request_and_closes_the_others() -> None:
    http, fake = http_and_fake()
    closed: list[str] = []

    async def generate(
        req: TokenizedGenerateReq, arrival: float | None = None, route: object = None
    ) -> AsyncIterator:
        try:
            yield StrOutput(req.rid, "x", [1], 3, 1, 0)
            if req.rid.endswith("-1"):
                yield StrOutput(req.rid, "", [], 3, 1, 0, Finish.error("fault", 500, "boom"))
                return
            await asyncio.Event().wait()  # the others would run on: they must be aborted
        finally:
            closed.append(req.rid)

    fake.generate = generate
    resp = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "request_id": "r"})
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "boom"
    assert sorted(closed) == ["cmpl-r-0", "cmpl-r-1", "cmpl-r-2"]
    assert vars(http.app.state.counters)["completion_tokens"] == 0
