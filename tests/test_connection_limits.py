"""The connection layer (issue 26, item 1): head size, head and body deadlines, the number of
connections, and a client that stops reading, against the real app served by uvicorn with
tessera's bounded protocol on 127.0.0.1 (no scheduler: the front door only)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from runtime.server_args import ServerArgs
from tokenizer_manager.api import body as body_module
from tokenizer_manager.http.connection_limits import ConnectionLimits, uvicorn_config
from tokenizer_manager.http.server import create_app
from tokenizer_manager.metrics import ServingMetrics

HEAD_S, BODY_S, SEND_S = 1.5, 1.5, 1.5
LIMITS = ConnectionLimits(
    max_header_bytes=16 << 10,
    header_timeout=HEAD_S,
    body_timeout=BODY_S,
    keep_alive_timeout=5,
    max_connections=100,
    send_timeout=SEND_S,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """An ASGI app under uvicorn with `limits`, in a thread of this process."""

    def __init__(self, app: object, limits: ConnectionLimits) -> None:
        self.port = free_port()
        config = uvicorn_config(app, "127.0.0.1", self.port, limits, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def fake_tm() -> SimpleNamespace:
    args = ServerArgs(model_path="/models/demo")
    return SimpleNamespace(
        args=args, context_length=128, healthy=lambda: True, metrics=ServingMetrics()
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    srv = ThreadServer(create_app(fake_tm()), LIMITS)
    yield srv
    srv.stop()


def closed_answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends before it closes `sock` (fails if it stays open `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def health_ok(server: ThreadServer) -> bool:
    return httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_trickling_heads_are_cut_off_while_health_answers(server: ThreadServer) -> None:
    """70 clients send a header byte every 0.3 s: each is answered 408 and closed within the
    head deadline (generous bound), and /health answers all the while."""
    socks = [server.connect() for _ in range(70)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
    open_socks, answers = set(socks), {}
    deadline = time.monotonic() + HEAD_S + 15
    while open_socks and time.monotonic() < deadline:
        assert health_ok(server)
        for s in list(open_socks):
            try:
                s.sendall(b"a")
            except OSError:  # closed by the server: read what it said
                answers[s] = closed_answer(s, 5)
                open_socks.discard(s)
        time.sleep(0.3)
    assert not open_socks, f"{len(open_socks)} trickling connections still open"
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers.values())
    assert any(a.startswith(b"HTTP/1.1 408") for a in answers.values())
    for s in socks:
        s.close()
    assert health_ok(server)


def test_a_huge_head_gets_431(server: ThreadServer) -> None:
    """A 16 MiB header is refused once the head passes the limit, not read in full."""
    with server.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        try:
            while sent < 16 << 20:
                s.sendall(b"a" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
        assert closed_answer(s, 10).startswith(b"HTTP/1.1 431")
    assert health_ok(server)


def test_a_trickling_body_gets_408(server: ThreadServer) -> None:
    with server.connect() as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        deadline = time.monotonic() + BODY_S + 15
        answer = None
        while answer is None and time.monotonic() < deadline:
            try:
                s.sendall(b" ")
                time.sleep(0.3)
            except OSError:
                answer = closed_answer(s, 5)
        assert answer is not None, "a trickling body was still read after the deadline"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408")
    assert health_ok(server)


def test_connections_beyond_the_limit_are_refused_with_503(server: ThreadServer) -> None:
    """Idle connections up to the limit; one more gets 503; the idle ones, which never send a
    byte, are closed by the head deadline."""
    socks = [server.connect() for _ in range(LIMITS.max_connections)]
    try:
        with server.connect() as extra:
            answer = closed_answer(extra, 10)
        assert answer.startswith(b"HTTP/1.1 503")
        for s in socks:
            idle = closed_answer(s, HEAD_S + 10)
            assert idle == b"" or idle.startswith(b"HTTP/1.1 408")
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10  # the server sees the closes, then serves again
    while True:
        try:
            if health_ok(server):
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "/health refused after the idle clients left"
        time.sleep(0.1)


async def endless_stream_app(scope: dict, receive: object, send: object) -> None:
    """A bare ASGI app streaming 64 KiB chunks for as long as they are taken."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(100_000):
        await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout() -> None:
    srv = ThreadServer(endless_stream_app, LIMITS)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        s.recv(100)  # the response started; now this client reads nothing more
        deadline = time.monotonic() + SEND_S + 20
        while srv.server.server_state.connections:
            assert time.monotonic() < deadline, "a client that stopped reading kept its socket"
            time.sleep(0.2)
        s.close()
    finally:
        srv.stop()


def test_300k_content_parts_are_refused_without_stalling_health(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300,000 one-letter parts: a 400 naming the limit, parsed and counted off the event loop,
    so /health keeps answering meanwhile. Checked by where the parse runs, not by a clock:
    validating this body on the loop held it for seconds."""
    parsed_on_loop: list[bool] = []
    load_json = body_module.load_json

    def recording_load_json(body: bytes) -> object:
        parsed_on_loop.append(_running_loop() is not None)
        return load_json(body)

    monkeypatch.setattr(body_module, "load_json", recording_load_json)
    parts = [{"type": "text", "text": "a"}] * 300_000
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": parts}]})
    headers = {"content-type": "application/json"}
    url = server.url + "/v1/chat/completions"
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: result.update(r=httpx.post(url, content=body, headers=headers, timeout=120))
    )
    sender.start()
    while sender.is_alive():
        assert health_ok(server)
    sender.join()
    resp = result["r"]
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages" and error["code"] == "too_many_content_parts"
    assert "2048" in error["message"]
    assert parsed_on_loop == [False]  # the 8 MB body was parsed in a thread


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def test_a_body_left_unsent_after_an_early_answer_gets_no_second_answer(
    server: ThreadServer,
) -> None:
    """A 413 answered from the declared length; the client never sends the body: the body
    deadline drops the connection without writing another response after the 413."""
    with server.connect() as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 104857600\r\n\r\n{"
        )
        answer = closed_answer(s, BODY_S + 10)
    assert answer.startswith(b"HTTP/1.1 413") and b"HTTP/1.1 408" not in answer


async def first_body_message_app(scope: dict, receive: object, send: object) -> None:
    """Waits before it reads the body (a busy event loop), then answers with the size of the
    first body message it got: what the connection read ahead meanwhile."""
    if scope["type"] != "http":
        return
    await asyncio.sleep(0.5)
    first = await receive()
    size, more = len(first["body"]), first["more_body"]
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.mark.parametrize("body_mb, read_ahead_mb", [(2, 4), (3, 1)])
def test_a_large_body_is_read_ahead_up_to_its_bound(body_mb: int, read_ahead_mb: int) -> None:
    """A multi-MiB body (a chat with images) arrives while the route is busy: it is read
    ahead, not paused after 64 KiB and resumed once per read by the route; past
    `body_read_ahead` the socket pauses, so what one connection makes the server hold stays
    bounded."""
    limits = ConnectionLimits(body_read_ahead=read_ahead_mb << 20, max_connections=10)
    srv = ThreadServer(first_body_message_app, limits)
    try:
        body = b"x" * (body_mb << 20)
        answer = httpx.post(srv.url, content=body, timeout=30).text
        first = int(answer)
        if body_mb <= read_ahead_mb:
            assert first == len(body)  # all of it read while the route slept
        else:
            assert (read_ahead_mb << 20) <= first < (read_ahead_mb << 20) + (1 << 20)
    finally:
        srv.stop()
