"""The server stays up: identical concurrent prompts, extreme sampling values, reused request ids,
error finishes shown as errors, backpressure and health (issue 10). One tp 2 server with the DP
encoder serves the whole module."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


@pytest.mark.parametrize("extreme", [{"temperature": 1e-39}, {"top_p": 1e-50}])
def test_extreme_sampling_values_do_not_kill_the_server(server: Server, extreme: dict) -> None:
    """Issue 10, seen 2: these rounded to 0 in float32 and torch.multinomial killed rank 0."""
    bodies = [
        chat_body("Say something.", max_tokens=5, ignore_eos=True, **extreme),
        chat_body("Say something.", max_tokens=5, ignore_eos=True, temperature=0),
    ]
    odd, greedy = [post(server, "/v1/chat/completions", b) for b in bodies]
    assert server.proc.poll() is None
    assert odd.status_code == 200, odd.text
    assert (
        odd.json()["choices"][0]["message"]["content"]
        == (greedy.json()["choices"][0]["message"]["content"])
    )


BAD_SAMPLING = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_completion_tokens", 0),
    ("temperature", 2.5),
    ("top_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("top_k", -2),
    ("min_p", 1.5),
    ("seed", "x"),
    ("seed", 2**64),
    ("stop", ["s"] * 17),
    ("stop", ["s" * 257]),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_sampling_params_out_of_openai_ranges_give_400(
    server: Server, field: str, value: object
) -> None:
    resp = post(server, "/v1/chat/completions", chat_body("hi", **{field: value}))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("params", [{"max_new_tokens": 0}, {"stop": ["s"] * 17}, {"top_p": 0}])
def test_native_sampling_params_are_checked(server: Server, params: dict) -> None:
    resp = post(server, "/generate", {"text": "hi", "sampling_params": params})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_sampling_params"


def media_worker_pids(server: Server) -> list[int]:
    """The main process's children that are not the scheduler ranks or the detokenizer."""
    known = {server.pid_of(n) for n in ("scheduler-TP0", "scheduler-TP1", "detokenizer")}
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text()
    return [int(p) for p in children.split() if int(p) not in known]


@pytest.mark.parametrize("victim", ["scheduler-TP0", "detokenizer"])
def test_a_dead_child_fails_every_client_and_leaves_no_process(
    folder: str, tmp_path: Path, victim: str
) -> None:
    srv = Server(folder, tmp_path / "server.log")
    try:
        post(srv, "/v1/chat/completions", chat_body([image_part()], max_tokens=2))  # warm media
        workers = media_worker_pids(srv)
        assert workers, "no media worker process found"
        long = chat_body("Tell a long story.", max_tokens=3000, temperature=0, ignore_eos=True)
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, srv, "/v1/chat/completions", long)
            streamed = pool.submit(stream_lines, srv, {**long, "stream": True}, victim)
            time.sleep(3)
            os.kill(srv.pid_of(victim), signal.SIGKILL)
            start = time.monotonic()
            resp, lines = plain.result(30), streamed.result(30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutdown"
        assert any('"error"' in line for line in lines) and lines[-1] == "data: [DONE]"
        srv.proc.wait(15)
        while srv.group_alive() and time.monotonic() - start < 10:
            time.sleep(0.2)
        assert not srv.group_alive(), "a child of the server outlived it"
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
        assert f"{victim} exited unexpectedly" in (tmp_path / "server.log").read_text()
    finally:
        srv.stop()


def image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": png_url(noise_image(seed=5))}}


def stream_lines(server: Server, body: dict, victim: str) -> list[str]:
    lines = []
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        lines.append(f"transport error after killing {victim}: {exc!r}")
    return lines

