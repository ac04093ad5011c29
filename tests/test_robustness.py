"""The server stays up: identical concurrent prompts, extreme sampling values, reused request ids,
error finishes shown as errors, backpressure and health (issue 10). One tp 2 server with the DP
encoder serves the whole module."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import pytest
from test_server import Server, idle_info, png_url, send_and_hold
from vlm_cases import noise_image
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint

KV_TOKENS, MAX_QUEUED, STALL_S = 1000, 2, 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("robust") / "qwen2_vl"))


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(
        folder,
        tmp_path_factory.mktemp("log") / "server.log",
        *("--max-total-tokens", str(KV_TOKENS), "--max-queued-requests", str(MAX_QUEUED)),
        *("--health-stall-timeout", str(STALL_S)),
    )
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
    """The processes under the main process that are not the scheduler ranks or the
    detokenizer: the media fork server and the workers forked from it."""
    known = {server.pid_of(n) for n in ("scheduler-TP0", "scheduler-TP1", "detokenizer")}
    return [pid for pid in server.children() if pid not in known]


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
        first_token = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, srv, "/v1/chat/completions", long)
            body = {**long, "stream": True}
            streamed = pool.submit(stream_lines, srv, body, victim, first_token)
            # both are generating once the stream (sent after the plain one) has its first token
            assert first_token.wait(120), "the streamed request never started"
            os.kill(srv.pid_of(victim), signal.SIGKILL)
            resp, lines = plain.result(60), streamed.result(60)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutdown"
        assert any('"error"' in line for line in lines) and lines[-1] == "data: [DONE]"
        srv.proc.wait(60)
        assert wait_until(lambda: not srv.group_alive()), "a child of the server outlived it"
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
        assert f"{victim} exited unexpectedly" in (tmp_path / "server.log").read_text()
    finally:
        srv.stop()


def image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": png_url(noise_image(seed=5))}}


def stream_lines(server: Server, body: dict, victim: str, started: threading.Event) -> list[str]:
    """The stream's lines; `started` is set at the first content chunk."""
    lines = []
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if '"content"' in line:
                    started.set()
    except httpx.HTTPError as exc:
        lines.append(f"transport error after killing {victim}: {exc!r}")
    return lines


def test_omitted_max_tokens_fits_the_kv_pool(server: Server) -> None:
    """Issue 10, seen 7: without max_tokens the request asked for context - prompt tokens, more
    than the KV pool holds, and was refused. Now it gets what fits: pool - prompt."""
    prompt = [7] * (KV_TOKENS - 5)
    body = {"model": "qwen2_vl", "prompt": prompt, "temperature": 0, "ignore_eos": True}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 5
    too_long = post(server, "/v1/completions", {**body, "prompt": [7] * KV_TOKENS})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def generate(server: Server, rid: str, timeout: float = 120, **params: object) -> httpx.Response:
    body = {"text": "Hello there", "rid": rid, "sampling_params": {"temperature": 0, **params}}
    return post(server, "/generate", body, timeout)


def test_client_rid_in_flight_is_refused_and_reusable_after_abort(server: Server) -> None:
    """With rank 0 frozen: a request with id "dup" waits; a second "dup" gets 409; the first
    client hangs up (abort); a third "dup" is sent while the abort is still queued, so the
    scheduler sees the abort and the new request in one step, and must keep them apart."""
    expected = generate(server, "fresh", max_new_tokens=6, ignore_eos=True).json()
    rank0 = server.pid_of("scheduler-TP0")
    native = {"text": "Hello there", "rid": "dup",
              "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    os.kill(rank0, signal.SIGSTOP)
    try:
        hung_up = disconnects(server)
        first = send_and_hold(server, "/generate", native)
        assert wait_until(lambda: health(server) == 503)  # in flight, nothing comes back
        again = generate(server, "dup", max_new_tokens=2)
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "duplicate_request_id"
        first.close()  # the client hangs up: the server aborts "dup"
        assert wait_until(lambda: disconnects(server) > hung_up and health(server) == 200)
        with ThreadPoolExecutor(1) as pool:
            reused = pool.submit(generate, server, "dup", max_new_tokens=6, ignore_eos=True)
            # in flight (so queued behind the abort) once /health sees it stall
            assert wait_until(lambda: health(server) == 503)
            os.kill(rank0, signal.SIGCONT)
            resp = reused.result(60)
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == expected["output_ids"]
    assert resp.json()["meta_info"]["id"] == "dup"
    assert_idle_and_clean(server)


def test_client_rid_reused_right_after_a_stop_string(server: Server) -> None:
    """Issue 10, seen 5: the detokenizer kept the old request's stop strings and state."""
    expected = generate(server, "plain", max_new_tokens=8, ignore_eos=True).json()
    text = expected["text"]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    first = generate(server, "again", max_new_tokens=8, ignore_eos=True, stop=[stop])
    assert first.json()["meta_info"]["finish_reason"]["matched"] == stop
    reused = generate(server, "again", max_new_tokens=8, ignore_eos=True)
    assert reused.status_code == 200, reused.text
    assert reused.json()["text"] == text
    assert_idle_and_clean(server)


def health(server: Server) -> int:
    return httpx.get(server.url + "/health", timeout=10).status_code


def disconnects(server: Server) -> int:
    """Client hang-ups the server has noticed (and aborted), from its log."""
    return server.log.read_text().count("client disconnected from")


def counters(server: Server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()["counters"]


def test_backpressure_health_and_abandoned_waiting_request(server: Server) -> None:
    """With rank 0 frozen nothing starts: a client that gives up while waiting is aborted and
    gets nothing, the queue cap answers 503 with Retry-After, and /health turns 503. Its
    request and its abort both wait in rank 0's socket; once rank 0 runs again they may reach
    it in one receive (aborted before its prefill) or two (aborted after its first token), so
    the server computed 0 or 1 token for it."""
    before = counters(server)
    rank0 = server.pid_of("scheduler-TP0")
    body = chat_body("Wait for it.", max_tokens=3, temperature=0, ignore_eos=True)
    os.kill(rank0, signal.SIGSTOP)
    try:
        hung_up = disconnects(server)
        abandoned = send_and_hold(server, "/v1/chat/completions", body)
        # in flight with nothing coming back: /health turns 503 after --health-stall-timeout
        assert wait_until(lambda: health(server) == 503)
        abandoned.close()
        assert wait_until(lambda: disconnects(server) > hung_up and health(server) == 200)
        with ThreadPoolExecutor(MAX_QUEUED + 1) as pool:
            waiting = [pool.submit(post, server, "/v1/chat/completions", body)]
            assert wait_until(lambda: health(server) == 503)  # that one waits
            # one more fills the queue, one is over the cap: whichever the server sees second
            # is refused at once
            pair = [pool.submit(post, server, "/v1/chat/completions", body) for _ in range(2)]
            done, _ = wait(pair, timeout=60, return_when=FIRST_COMPLETED)
            assert len(done) == 1
            over = done.pop().result()
            assert over.status_code == 503, over.text
            assert over.headers["retry-after"] == "1"
            assert over.json()["error"]["code"] == "server_overloaded"
            waiting += [f for f in pair if not f.done()]
            assert len(waiting) == MAX_QUEUED
            os.kill(rank0, signal.SIGCONT)
            assert all(f.result(60).status_code == 200 for f in waiting)
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    after = counters(server)
    assert after["aborted"] == before["aborted"] + 1
    abandoned_tokens = after["generated_tokens"] - before["generated_tokens"] - 3 * MAX_QUEUED
    assert abandoned_tokens in (0, 1)
    assert_idle_and_clean(server)
