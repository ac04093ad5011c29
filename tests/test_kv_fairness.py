"""One request cannot hold the KV pool against all others (issue 57): a tp 1 server with an
8,200-token KV pool refuses choices that can never fit it together (a 400 naming n; before, 64
choices of 8,000 tokens were accepted), and two big requests that fill it do not starve a
small one sent once it is full."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_openai_sampling import OneRankServer
from test_server import Server, idle_info, serve_then_check_teardown, server_info
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint

KV_TOKENS = 8200  # one choice of 8,000 tokens fits, 64 do not; nor two big requests


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("kv") / "qwen2_vl")
    log = tmp_path_factory.mktemp("log") / "server.log"
    kv = ("--max-total-tokens", str(KV_TOKENS), "--context-length", str(KV_TOKENS + 100))
    srv = OneRankServer(str(folder), log, *kv)
    yield from serve_then_check_teardown(srv)


def complete(server: Server, prompt: list[int], max_tokens: int, **kw: object) -> httpx.Response:
    body = {
        "model": "qwen2_vl",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }
    return httpx.post(server.url + "/v1/completions", json=body, timeout=600)


def test_choices_that_never_fit_the_pool_are_a_400_naming_n(server: Server) -> None:
    body = {
        "model": "qwen2_vl",
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "n": 64,
        "max_tokens": 8000,
        "ignore_eos": True,
    }
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("n", "kv_pool_exceeded")
    fits = complete(server, [5] * 20, 40, n=4)  # 20 + 4 x 40 fits
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"]) == 4


def test_two_big_requests_that_fill_the_pool_do_not_starve_a_small_one(server: Server) -> None:
    """Each big one (a 3,800-token prompt, 2,000 output tokens) fits the pool alone, not both
    together. A small one sent once the pool is full (the first retraction) finishes before
    either big one: it waits a few steps for KV, then takes what is free or preempts the
    largest holder (before: it waited behind the retracted big one until the other ended)."""
    before = server_info(server)["counters"]["retractions"]
    done: dict[str, float] = {}

    def run(name: str, prompt: list[int], max_tokens: int) -> httpx.Response:
        resp = complete(server, prompt, max_tokens)
        done[name] = time.monotonic()
        return resp

    with ThreadPoolExecutor(3) as pool:
        bigs = [pool.submit(run, f"big{i}", [7 + i] * 3800, 2000) for i in range(2)]
        full = wait_until(lambda: server_info(server)["counters"]["retractions"] > before, 300)
        assert full and not done, "the pool did not fill while both big requests ran"
        small = pool.submit(run, "small", [11] * 20, 8)
        responses = [f.result() for f in [*bigs, small]]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert responses[2].json()["usage"]["completion_tokens"] == 8
    assert done["small"] < min(done["big0"], done["big1"]), done
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"] == KV_TOKENS
    assert info["kv_protected"] == 0
