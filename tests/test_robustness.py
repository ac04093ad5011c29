"""The server stays up: identical concurrent prompts, extreme sampling values, reused request ids,
error finishes shown as errors, backpressure and health (issue 10). One tp 2 server with the DP
encoder serves the whole module."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from make_tiny_checkpoint import make_checkpoint
from test_server import Server, idle_info, png_url
from vlm_cases import noise_image


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("robust") / "qwen2_vl"))


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(folder, tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    srv.stop()


def chat_body(content: object, **kw: object) -> dict:
    return {"model": "qwen2_vl", "messages": [{"role": "user", "content": content}], **kw}


def post(server: Server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def at_once(server: Server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """Post every body at the same moment (threads behind a barrier); responses in order."""
    barrier = threading.Barrier(len(bodies))

    def send(body: dict) -> httpx.Response:
        barrier.wait()
        return post(server, path, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def assert_idle_and_clean(server: Server) -> dict:
    info = idle_info(server)
    assert info["running"] == 0 and info["waiting"] == 0
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["kv_protected"] == 0 and info["encoder_cache"]["pins"] == 0
    return info


def test_identical_concurrent_image_prompts_both_finish(server: Server) -> None:
    """Issue 10, seen 1: the same image and text at the same moment, max_tokens 6 and 10 with
    ignore_eos, used to kill every rank in `if req in self.running` (dataclass equality)."""
    content = [
        {"type": "image_url", "image_url": {"url": png_url(noise_image(seed=11))}},
        {"type": "text", "text": "Twins?"},
    ]
    for attempt in range(3):  # the crash needs the longer request ahead in the running list
        bodies = [chat_body(content, max_tokens=n, temperature=0, ignore_eos=True) for n in (10, 6)]
        long, short = at_once(server, "/v1/chat/completions", bodies)
        assert server.proc.poll() is None, f"server died on attempt {attempt}"
        for resp, n in ((long, 10), (short, 6)):
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == n
        text = [r.json()["choices"][0]["message"]["content"] for r in (long, short)]
        assert text[0].startswith(text[1])
    assert_idle_and_clean(server)
