"""The HTTP front door on its own (no scheduler): body size, JSON parsing, API key dependency."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from runtime.server_args import ServerArgs
from tokenizer_manager.http.server import create_app, media_scope
from tokenizer_manager.metrics import ServingMetrics

LIMIT = 4096


def client(api_key: str | None = None, limit: int = LIMIT) -> TestClient:
    args = ServerArgs(model_path="/models/demo", api_key=api_key, max_request_bytes=limit)
    fake_tm = SimpleNamespace(
        args=args, context_length=128, healthy=lambda: True, metrics=ServingMetrics()
    )
    return TestClient(create_app(fake_tm))


def post(http: TestClient, body: bytes | Iterator[bytes], **headers: str) -> tuple[int, dict]:
    resp = http.post(
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", **headers},
    )
    return resp.status_code, resp.json()


def test_request_body_limit_gives_413_before_reading_it_all() -> None:
    http = client()
    status, body = post(http, b"{" + b" " * LIMIT + b"}")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    sent = []

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        for _ in range(100):
            sent.append(1)
            yield b" " * 1024

    status, body = post(http, chunks())
    assert status == 413 and body["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "demo", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "demo", "temperature": NaN}',
        b'{"model": "demo", "temperature": Infinity}',
        b'{"model": "\xff\xfe"}',
        b"[1, 2]",
        b'{"model": "demo", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"model": "demo", "\\udfff": 1}',
    ],
    ids=[
        "malformed",
        "deep",
        "huge_int",
        "nan",
        "infinity",
        "bad_utf8",
        "not_an_object",
        "lone_surrogate",
        "lone_surrogate_key",
    ],
)
def test_bad_json_is_a_400(body: bytes) -> None:
    http = client(limit=1 << 20)
    status, reply = post(http, body)
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_api_key_dependency_guards_every_route_but_health() -> None:
    http = client("sekret")
    assert http.get("/health").status_code == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/server_info"),
        ("GET", "/metrics"),
        ("POST", "/flush_cache"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
    ]:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Bearer sekret2"}):
            resp = http.request(method, path, headers=headers)
            assert resp.status_code == 401, (path, headers)
            assert resp.json()["error"]["code"] == "invalid_api_key"
    ok = http.get("/v1/models", headers={"authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "demo"


def test_api_key_may_be_given_for_several_callers() -> None:
    assert ServerArgs.from_cli(["--api-key", "a", "--api-key", "b"]).api_key == ("a", "b")
    assert ServerArgs.from_cli([]).api_key == () and ServerArgs(api_key="k").api_key == ("k",)
    args = ServerArgs(model_path="/models/demo", api_key=("a", "b"))
    http = TestClient(create_app(
        SimpleNamespace(args=args, context_length=128, metrics=ServingMetrics())
    ))
    for key, status in (("a", 200), ("b", 200), ("c", 401), ("ab", 401)):
        reply = http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert reply.status_code == status, key
    with pytest.raises(ValueError, match="empty"):
        ServerArgs(api_key=("a", ""))


def test_each_key_is_its_own_media_scope() -> None:
    scopes = {media_scope(f"Bearer {key}".encode()) for key in ("a", "b")}
    assert len(scopes) == 2 and "" not in scopes
    assert all(len(s) == 32 for s in scopes)  # a digest, never the key itself


def test_api_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("from-a-file\n")
    args = ServerArgs.from_cli(["--api-key-file", str(key), "--device", "cpu"])
    assert args.api_key == ("from-a-file",)
    key.write_text("first\n\n  second \n")
    assert ServerArgs.from_cli(["--api-key-file", str(key)]).api_key == ("first", "second")
    with pytest.raises(ValueError, match="api-key"):
        ServerArgs.from_cli(["--api-key-file", str(key), "--api-key", "x", "--device", "cpu"])
    key.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        ServerArgs.from_cli(["--api-key-file", str(key), "--device", "cpu"])


@pytest.mark.parametrize("rid", ["r" * (1 << 20), "r" * 129, "a b", "a\nb", "é", ""])
def test_rid_has_a_length_and_character_limit(rid: str) -> None:
    resp = client(limit=4 << 20).post("/generate", json={"text": "hi", "rid": rid})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "rid"
