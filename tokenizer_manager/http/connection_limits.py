"""The HTTP connection layer's bounds, as a subclass of uvicorn's httptools protocol: a request's
head has a size limit (431) and a deadline (408), its body a deadline (408), the server a number
of open connections (503, then closed), and a response write that the client does not take for
a while drops the connection (which aborts its request, as a hang-up does); what such a client
makes the server buffer is bounded per connection (invariant 18). Keep-alive idle time
is uvicorn's own `timeout_keep_alive`. Each refusal costs a few bytes and a closed socket, never
a task, so thousands of slow connections cannot slow `/health` or anyone's request.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from runtime.logging_utils import get_logger
from runtime.server_args import ServerArgs

logger = get_logger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int = 64 << 10  # request line and headers of one request
    header_timeout: float = 10.0  # from a connection's (or a request's) first byte to its head
    body_timeout: float = 60.0  # from the head to the body's last byte
    keep_alive_timeout: float = 5.0  # idle time between requests on one connection
    max_connections: int = 1024  # open connections; beyond: 503 and closed
    send_timeout: float = 30.0  # a response write blocked this long drops the connection
    send_buffer_bytes: int = 256 << 10  # per connection: the kernel's send buffer, and ours
    body_read_ahead: int = 4 << 20  # request body read before the route takes it; then paused

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> ConnectionLimits:
        return cls(
            max_header_bytes=args.http_max_header_bytes,
            header_timeout=args.http_header_timeout,
            body_timeout=args.http_body_timeout,
            keep_alive_timeout=args.http_keep_alive_timeout,
            max_connections=args.http_max_connections,
            send_timeout=args.http_send_timeout,
            send_buffer_bytes=args.http_send_buffer_bytes,
        )


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits, **kw: Any) -> Any:
    """The uvicorn config every tessera HTTP server runs with: the bounded protocol."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=functools.partial(BoundedHttpProtocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_timeout,
        **kw,
    )


def _plain_response(status: int) -> bytes:
    return STATUS_LINE[status] + b"content-length: 0\r\nconnection: close\r\n\r\n"


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of `ConnectionLimits`."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.limits = limits
        self.head_bytes: int | None = 0  # bytes of the head being read; None: not reading one
        self.read_deadline: asyncio.TimerHandle | None = None
        self.send_deadline: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.debug("over %d connections: refused", self.limits.max_connections)
            self.refuse(503)
            return
        self.bound_send_buffers(transport)
        self.arm_read_deadline(self.limits.header_timeout)

    def bound_send_buffers(self, transport: asyncio.Transport) -> None:
        """What a client that stops reading can make this server hold: the kernel's send
        buffer (not grown past the limit: Linux would let it reach 4 MiB) and the transport's
        (past it, writes pause and the send deadline starts)."""
        size = self.limits.send_buffer_bytes
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        transport.set_write_buffer_limits(high=size)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm(self.read_deadline)
        self.disarm(self.send_deadline)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; a head still unfinished after more than the limit is refused (a
        read is at most a few hundred KiB, so the parser never holds much more)."""
        if self.transport.is_closing():
            return
        reading_head = self.head_bytes is not None
        super().data_received(data)
        if reading_head and self.head_bytes is not None:  # the head did not end in `data`
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_header_bytes:
                logger.debug("request head over %d bytes: refused", self.limits.max_header_bytes)
                self.refuse(431)

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.head_bytes is None:  # a new request on a kept-alive (or pipelined) connection
            self.head_bytes = 0
            self.arm_read_deadline(self.limits.header_timeout)

    def on_headers_complete(self) -> None:
        self.head_bytes = None
        self.arm_read_deadline(self.limits.body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """uvicorn pauses the socket once 64 KiB of body wait for the route, so a body of a
        few MiB (a chat with images) crossed the event loop once per read, each crossing
        behind whatever else the loop was doing (4-9 ms for a 1.6 MB body with four chats at
        a time). Up to `body_read_ahead` bytes are read ahead instead; the route reads the
        whole body anyway, and refuses one over `max_request_bytes` as it arrives."""
        super().on_body(body)
        cycle = self.cycle
        if cycle is not None and len(cycle.body) <= self.limits.body_read_ahead:
            self.flow.resume_reading()

    def on_message_complete(self) -> None:
        self.disarm(self.read_deadline)
        super().on_message_complete()

    # ------------------------------------------------------------------ deadlines
    def arm_read_deadline(self, seconds: float) -> None:
        self.disarm(self.read_deadline)
        self.read_deadline = self.loop.call_later(seconds, self.refuse, 408)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.disarm(self.send_deadline)
        self.send_deadline = self.loop.call_later(self.limits.send_timeout, self.send_expired)

    def resume_writing(self) -> None:
        self.disarm(self.send_deadline)
        super().resume_writing()

    def send_expired(self) -> None:
        """The client took nothing for the send timeout: drop the connection; the route sees a
        hang-up (its request is aborted) and the buffered response is freed."""
        logger.info("a client stopped reading for %.0f s: connection dropped",
                    self.limits.send_timeout)
        self.transport.abort()

    @staticmethod
    def disarm(handle: asyncio.TimerHandle | None) -> None:
        if handle is not None:
            handle.cancel()

    def refuse(self, status: int) -> None:
        """Answer `status` and close, when the connection is between responses; a route still
        reading its request sees a hang-up. Where a response has begun (or, for a body that
        stopped arriving, already ended) the connection is only dropped."""
        self.disarm(self.read_deadline)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        between = cycle is None or (cycle.response_complete and self.head_bytes is not None)
        unanswered = cycle is not None and self.head_bytes is None and not cycle.response_started
        if not (between or unanswered):
            self.transport.abort()
            return
        if unanswered:
            cycle.disconnected = True  # the route writes nothing after this answer
            cycle.message_event.set()
        self.transport.write(_plain_response(status))
        self.transport.close()
