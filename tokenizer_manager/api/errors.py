"""The last word on a failure: an exception that escapes a route (or a middleware inside this one)
becomes OpenAI error JSON, never a plain-text 500, and is counted and logged with its traceback.

`InternalErrorGuard` is tessera's outermost ASGI layer; only Starlette's ServerErrorMiddleware
sits outside it. That one cannot be the guard: it calls an `Exception` handler with a request
that has no receive channel (so `request.is_disconnected()` there raises, and the handler's own
failure became the plain-text 500 of issue 57), and it re-raises after answering. Here the
guard sees every message the route sent, so it also knows how to end a response that began:
an event stream gets an error event and `[DONE]`; any other response is cut (the server then
drops the connection: a truncated JSON body must not look complete).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.logging_utils import get_logger
from tokenizer_manager.api.sse import DONE, error_event
from tokenizer_manager.api.usage import ApiCounters
from tokenizer_manager.protocol import APIError

logger = get_logger(__name__)

CLIENT_GONE = 499  # the status logged for a client that left before its answer


def internal_error(exc: BaseException) -> APIError:
    """The client's view of a failure of tessera's own: a 500 naming only the exception's type
    (its message may hold request data or internals)."""
    return APIError(f"internal error: {type(exc).__name__}", status=500, code="internal_error")


def count_internal_error(counters: ApiCounters, path: str, exc: BaseException) -> None:
    """Count a failure of tessera's own (/server_info "api", /metrics tessera_api_server_errors)
    and log it with its traceback."""
    counters.server_errors += 1
    logger.error("internal error on %s", path, exc_info=exc)


@dataclass
class _Exchange:
    """What one request's route has sent and seen so far."""

    started: bool = False  # the response's head was sent
    finished: bool = False  # its last body part was sent
    event_stream: bool = False
    client_gone: bool = False  # receive returned http.disconnect

    def sent(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


class InternalErrorGuard:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp, counters: ApiCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange()

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                exchange.client_gone = True
            return message

        async def watched_send(message: Message) -> None:
            exchange.sent(message)
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception as exc:  # noqa: BLE001 - the point of this layer
            await self.answer(scope["path"], exc, exchange, send)

    async def answer(self, path: str, exc: Exception, exchange: _Exchange, send: Send) -> None:
        if exchange.client_gone or isinstance(exc, ClientDisconnect):
            logger.info("client gone from %s: %s", path, type(exc).__name__)
            if not exchange.started:
                await send_empty(send, CLIENT_GONE)
            return
        count_internal_error(self.counters, path, exc)
        if not exchange.started:
            await send_json(send, internal_error(exc))
        elif exchange.event_stream and not exchange.finished:
            body = error_event(internal_error(exc)) + DONE
            await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, err: APIError) -> None:
    """`err` as a whole JSON response, in raw ASGI messages."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_empty(send: Send, status: int) -> None:
    headers = [(b"content-length", b"0")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
