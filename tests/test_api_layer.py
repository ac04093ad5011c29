"""The API layer on its own (a fake TokenizerManager): what each API turns a request into and how
its outputs come back, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from runtime.io_struct import Finish, FinishKind, StrOutput, TokenizedGenerateReq
from runtime.server_args import ServerArgs
from tokenizer_manager.http_server import create_app
from tokenizer_manager.tokenizer_manager import GenerateInput


class FakeManager(SimpleNamespace):
    """Takes every request, records its GenerateInput and answers "ok" then "!" (2 tokens)."""

    def __init__(self, **args: Any) -> None:
        super().__init__(
            args=ServerArgs(model_path="/models/demo", **args),
            context_length=128,
            stalled=lambda: False,
            seen=[],
            params=[],
        )

    async def tokenize_request(self, inp: GenerateInput) -> TokenizedGenerateReq:
        self.seen.append(inp)
        params = inp.sampling(100)
        self.params.append(params)
        return TokenizedGenerateReq(inp.rid, [1, 2, 3], params, None, inp.stream)

    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None
    ) -> AsyncIterator[StrOutput]:
        yield StrOutput(req.rid, "ok", [7], 3, 1, 0)
        yield StrOutput(req.rid, "!", [8], 3, 2, 1, Finish(FinishKind.STOP))


@pytest.fixture
def fake() -> FakeManager:
    return FakeManager()


@pytest.fixture
def http(fake: FakeManager) -> TestClient:
    return TestClient(create_app(fake))


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
