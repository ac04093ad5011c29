"""Encoder servers that die: an LLM server with two encoder servers loses one mid-load and its
jobs go to the other (every request answers, with the right text); with none left an image
request, sent to its replica before its encoder job failed (its text prefilled, parked for the
image), is its own 503 (OpenAI JSON, streamed or not) while text requests are served; a
restarted encoder server is used again; `--encoder-fallback local` encodes on the ranks when no
server answers, and a client that hangs up while its media are pending leaves nothing behind.
Every server's idle check holds and no shared-memory file is left (the fixtures' teardown)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from dist_utils import free_port
from encoder_servers import EncoderProc, start_encoder
from test_encoder_disagg import (
    TEXT,
    assert_idle_and_leak_free,
    encoded,
    one_image,
    text_of,
)
from test_server import NEW_TOKENS, Server, chat_oracle, image_part, serve_then_check_teardown
from vlm_cases import noise_image
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("faults") / "qwen2_vl"))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict:
    return chat_oracle(folder, (56, 84), NEW_TOKENS)


def kill(proc: EncoderProc) -> None:
    os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait()
    assert wait_until(lambda: not proc.group_alive())


def image_chat(
    server: Server, seed: int, stream: bool = False, timeout: float = 300, lead: str = ""
) -> httpx.Response:
    """A chat with one new image (and `lead`, text before it)."""
    content = [image_part(noise_image((56, 56), seed=seed)), {"type": "text", "text": "Hi."}]
    content = [{"type": "text", "text": lead}, *content] if lead else content
    body = {"model": "qwen2_vl", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, "stream": stream}  # fmt: skip
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


def assert_encoder_503(reply: httpx.Response) -> None:
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "no encoder server" in error["message"]


def test_a_dead_encoder_server_fails_over_then_503_then_is_used_again(
    folder: str, oracle: dict, tmp_path: Path
) -> None:
    first = start_encoder(folder, tmp_path / "a.log")
    second = start_encoder(folder, tmp_path / "b.log")
    urls = f"{first.job_url},{second.job_url}"
    flags = ["--tp", "1", "--encoder-urls", urls, "--encoder-timeout", "20"]
    server = Server(folder, tmp_path / "llm.log", *flags)
    try:
        for _ in serve_then_check_teardown(server):
            with ThreadPoolExecutor(6) as pool:  # one dies while these are in flight
                replies = [pool.submit(image_chat, server, seed) for seed in range(100, 106)]
                kill(first)
                codes = [r.result().status_code for r in replies]
            assert codes == [200] * 6
            assert text_of(server, one_image()) == oracle["text"]["one_image"]
            kill(second)
            parked = counters(server)["parked"]
            lead = "Read this first, then look. " * 8  # new text: it prefills, then parks
            assert_encoder_503(image_chat(server, 200, lead=lead))  # its job waits a connect
            assert counters(server)["parked"] > parked  # its text ran before the job failed
            assert_encoder_503(image_chat(server, 202, stream=True))
            assert text_of(server, [{"type": "text", "text": TEXT}])  # text needs no encoder
            assert_idle_and_leak_free(server)
            back = start_encoder(folder, tmp_path / "a2.log", port=first.port)
            try:
                assert image_chat(server, 201).status_code == 200
                assert encoded(back)["jobs"] >= 1  # the restarted server took the job
                media = httpx.get(server.url + "/server_info").json()["media"]
                assert media["encoder_servers"]["servers"][0]["up"] is True
                assert_idle_and_leak_free(server)
            finally:
                back.stop()
    finally:
        server.stop()  # a failed assertion leaves the teardown check unrun: nothing is left
        for proc in (first, second):
            if proc.proc.poll() is None:
                proc.stop()


def server_info(server: Server) -> dict:
    return httpx.get(server.url + "/server_info").json()


def counters(server: Server) -> dict:
    return server_info(server)["counters"]


def test_spill_sends_the_pixels_at_once_while_no_encoder_server_is_up(
    folder: str, oracle: dict, tmp_path: Path
) -> None:
    """--encoder-fallback spill: the first request's job fails (nothing listens) and its pixels
    follow it; from then on no server is up, so a request's media go with it to the ranks at
    once (spilled, no job waited on), and the outputs stay HF's."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    flags = ["--tp", "1", "--encoder-urls", dead, "--encoder-fallback", "spill"]
    server = Server(folder, tmp_path / "llm.log", *flags)
    try:
        for _ in serve_then_check_teardown(server):
            assert text_of(server, one_image()) == oracle["text"]["one_image"]
            pool = server_info(server)["media"]["encoder_servers"]
            assert pool["spilled_requests"] == 0 and not pool["servers"][0]["up"]
            assert text_of(server, one_image()) == oracle["text"]["one_image"]
            assert image_chat(server, 301).status_code == 200
            assert server_info(server)["media"]["encoder_servers"]["spilled_requests"] == 2
            assert_idle_and_leak_free(server)
    finally:
        server.stop()


def test_fallback_local_encodes_on_the_ranks(folder: str, oracle: dict, tmp_path: Path) -> None:
    """The request goes at once; its job fails (nothing listens) and its pixels follow it. A
    client that hangs up while its job is pending is aborted: nothing held, no file left."""
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    flags = ["--tp", "1", "--encoder-urls", dead, "--encoder-fallback", "local"]
    server = Server(folder, tmp_path / "llm.log", *flags)
    try:
        for _ in serve_then_check_teardown(server):
            assert "no vision tower" not in server.log.read_text()
            assert text_of(server, one_image()) == oracle["text"]["one_image"]
            assert "its ranks encode its media" in server.log.read_text()
            assert_idle_and_leak_free(server)
            aborted = counters(server)["aborted"]
            with pytest.raises(httpx.ReadTimeout):  # the job waits a second for a connection
                image_chat(server, 300, timeout=0.3)
            assert wait_until(lambda s=server, n=aborted: counters(s)["aborted"] > n)
            assert_idle_and_leak_free(server)
            assert image_chat(server, 300).status_code == 200
    finally:
        server.stop()
