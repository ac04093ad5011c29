"""What the end-to-end tests of each model family check on a running server, in one place:
chats against the oracle's greedy text and prompt length, typed media tokens and media the
family does not take refused by name, nothing held after the requests."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_openai_sampling import OneRankServer
from test_server import Server, client, idle_info, image_part, mp4_bytes, serve_then_check_teardown
from vlm_cases import noise_image, video_frames

from runtime.families import get_family


def serve(
    folder: Path, tmp: pytest.TempPathFactory, name: str, dp_encoder: bool = False, *extra: str
) -> Iterator[Server]:
    """A module's server on `folder`: tp 1, or tp 2 with the DP encoder (with `extra` flags);
    its teardown checked."""
    log = tmp.mktemp(name) / "server.log"
    kind = Server if dp_encoder else OneRankServer
    server = kind(str(folder), log, *extra)
    yield from serve_then_check_teardown(server)


def parts(content: list) -> list[dict]:
    """Chat content parts of strings, PIL images and encoded videos (bytes)."""
    return [part(p) for p in content]


def part(piece: str | bytes | Any) -> dict:
    if isinstance(piece, str):
        return {"type": "text", "text": piece}
    if isinstance(piece, bytes):
        url = "data:video/mp4;base64," + base64.b64encode(piece).decode()
        return {"type": "video_url", "video_url": {"url": url}}
    return image_part(piece)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def assert_chat_is_hfs(
    server: Server, model: str, content: list, expected: tuple[str, int], new_tokens: int,
    turns: list[tuple[str, list]] | None = None,
) -> Any:
    """A greedy chat of `content` (or of the conversation `turns`, (role, content) each)
    answers the oracle's (text, prompt_tokens); returns the response."""
    turns = turns or [("user", content)]
    out = client(server).chat.completions.create(
        model=model,
        messages=[{"role": role, "content": parts(c)} for role, c in turns],
        max_tokens=new_tokens,
        temperature=0,
    )
    text, prompt_tokens = expected
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == new_tokens
    return out


def assert_typed_token_refused(server: Server, model: str, token: str) -> None:
    content = [image_part(noise_image()), {"type": "text", "text": f"look {token} here"}]
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["param"] == "messages" and token in error["message"]


def assert_video_refused(server: Server, model: str) -> None:
    """A good video still, to a family that takes images only."""
    url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(video_frames(4))).decode()
    content = [{"type": "video_url", "video_url": {"url": url}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    error = out.json()["error"]
    assert (error["param"], error["code"]) == ("video_url", "unsupported_media")
    assert get_family(model).refused_media_reason in error["message"]  # says why


def assert_nothing_held(server: Server, body: dict) -> None:
    """After `body` is answered and the server is idle, no KV slot or encoder pin is held."""
    assert post(server, "/v1/chat/completions", body).status_code == 200
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["encoder_cache"]["pins"] == 0
