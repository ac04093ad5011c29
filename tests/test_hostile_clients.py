"""Clients that try to hurt everyone else (issue 26, items 5 and 6), against one tp 1 server:
a streaming client that stops reading, a prompt far too long for the context, a request of
300,000 content parts. The server stays healthy and frees what such a request held."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from make_tiny_checkpoint import make_checkpoint
from stress import LaunchedServer, stop_and_time
from test_server import idle_info

SEND_S, STALL_S = 2, 0.5  # a finished request's stalled client outlives the stall timeout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("hostile") / "qwen2_vl")
    flags = ["--model-path", str(folder), "--device", "cpu", "--max-total-tokens", "8000"]
    flags += ["--http-send-timeout", str(SEND_S), "--http-send-buffer-bytes", "4096"]
    flags += ["--health-stall-timeout", str(STALL_S)]
    srv = LaunchedServer(flags, tmp_path_factory.mktemp("log") / "server.log")
    try:
        srv.wait_healthy(240)
        yield srv
    finally:
        stop_and_time(srv)


def info(server: LaunchedServer) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()


def health(server: LaunchedServer) -> int:
    return httpx.get(server.url + "/health", timeout=10).status_code


def chat(content: object, **kw: object) -> dict:
    return {"model": "qwen2_vl", "messages": [{"role": "user", "content": content}], **kw}


def stalled_stream(server: LaunchedServer, max_tokens: int) -> socket.socket:
    """A streaming chat whose client reads the first bytes, then nothing (small receive
    buffer: the server's writes soon wait for it)."""
    body = json.dumps(
        chat("Tell me a story.", max_tokens=max_tokens, temperature=0, ignore_eos=True,
             stream=True)
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def rest_of(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def wait_until_done(server: LaunchedServer, deadline_s: float) -> None:
    """Until no request is in flight at the API, checking /health is 200 all the while (every
    0.1 s; /server_info, whose answer counts as the scheduler's progress, once a second)."""
    deadline = time.monotonic() + deadline_s
    while info(server)["api"]["in_flight"]:
        for _ in range(10):
            assert health(server) == 200, "a client that stopped reading turned /health to 503"
            time.sleep(0.1)
        assert time.monotonic() < deadline, "a stalled client's request is still held"


def assert_kv_all_free(server: LaunchedServer) -> None:
    idle = idle_info(server)
    assert idle["running"] == 0 and idle["waiting"] == 0
    assert idle["kv_free"] + idle["kv_evictable"] == idle["kv_total"]


def test_a_client_that_stops_reading_is_aborted(server: LaunchedServer) -> None:
    """A long stream to a client that reads nothing: after the send timeout the connection
    is dropped and the request aborted mid-generation; its KV is free again."""
    before = info(server)["counters"]
    sock = stalled_stream(server, max_tokens=3900)
    wait_until_done(server, SEND_S + 120)
    assert_kv_all_free(server)
    after = info(server)["counters"]
    assert after["aborted"] == before["aborted"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 3900
    assert b"[DONE]" not in rest_of(sock)
    sock.close()
    assert health(server) == 200


def test_a_finished_request_with_a_stalled_client_keeps_health_up(server: LaunchedServer) -> None:
    """The request ends while its client still reads nothing: a stalled client is not a stalled
    server, so /health stays 200 past --health-stall-timeout until the connection is dropped."""
    sock = stalled_stream(server, max_tokens=300)
    wait_until_done(server, SEND_S + 120)
    sock.close()
    assert_kv_all_free(server)
