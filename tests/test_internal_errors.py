"""Every failure of tessera's own is OpenAI error JSON (issue 57): an exception that escapes a
route of the real app (create_app over a fake TokenizerManager) is a JSON 500, counted in
/server_info and /metrics and logged with its traceback; a stream that already began ends with
an error event and [DONE]."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from test_api_layer import CHAT, NATIVE, FakeManager

from runtime.io_struct import StrOutput, TokenizedGenerateReq
from tokenizer_manager.http.server import create_app
from tokenizer_manager.tokenizer_manager import GenerateInput


class Fake(FakeManager):
    async def server_infos(self) -> list:
        return []  # no scheduler: /metrics shows the API counters only


class RecursionInCheck(Fake):
    """A check awaited by the route raises what no handler knows (as llguidance's "recursion
    limit exceeded" did for a deeply nested schema)."""

    async def tokenize_request(self, inp: GenerateInput) -> TokenizedGenerateReq:
        raise ValueError("recursion limit exceeded")


class FailsMidStream(Fake):
    """The first output arrives (the stream begins), then the output path fails."""

    async def generate(
        self, req: TokenizedGenerateReq, arrival: float | None = None, route: object = None
    ) -> AsyncIterator[StrOutput]:
        yield StrOutput(req.rid, "ok", [7], 3, 1, 0, None)
        raise RuntimeError("lost the detokenizer's output")


def client(fake: Fake) -> TestClient:
    return TestClient(create_app(fake), raise_server_exceptions=False)


def server_errors(http: TestClient) -> tuple[int, float]:
    """(/server_info's api.server_errors, /metrics' tessera_api_server_errors)."""
    info = http.app.state.counters.server_errors  # what /server_info shows as api
    metrics = http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("tessera_api_server_errors"))
    return info, float(line.split()[-1])


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"}), ("/generate", NATIVE)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_exception_in_a_route_is_a_counted_json_500(
    path: str, body: dict, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    http = client(RecursionInCheck())
    with caplog.at_level(logging.ERROR):
        resp = http.post(path, json={**body, "stream": stream})
    assert resp.status_code == 500
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "internal_server_error" and error["message"].endswith("ValueError")
    assert set(error) == {"message", "type", "param", "code"}
    assert server_errors(http) == (1, 1.0)
    logged = [r for r in caplog.records if "internal error on" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # with its traceback


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_that_began_ends_with_an_error_event(path: str) -> None:
    http = client(FailsMidStream())
    body = CHAT if path == "/v1/chat/completions" else {"prompt": "hi"}
    resp = http.post(path, json={**body, "stream": True})
    assert resp.status_code == 200  # the head went out with the first output
    events = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "internal_server_error"
    assert len(events) >= 3  # at least one ordinary chunk came before the error
    assert server_errors(http) == (1, 1.0)


def test_client_errors_keep_their_handlers() -> None:
    """The guard takes only what no handler answered: a 400 stays a 400, uncounted as ours."""
    http = client(Fake())
    resp = http.post("/v1/chat/completions", json={"messages": "not a list"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert server_errors(http) == (0, 0.0)
