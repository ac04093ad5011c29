"""The one server-sent-events writer: every streaming route hands it a `StreamWriter` that turns
outputs into payloads; the writer adds the framing, the error event, usage and `[DONE]`."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.io_struct import StrOutput
from tokenizer_manager.api.outputs import cancel_when, finish_error, merged
from tokenizer_manager.api.usage import UsageRecorder
from tokenizer_manager.protocol import APIError

DONE = b"data: [DONE]\n\n"


class StreamWriter(Protocol):
    """An API's stream shape: payloads to send first (given each stream's first output), per
    output of choice `index`, and last."""

    def opening(self, firsts: list[StrOutput]) -> list[dict[str, Any]]: ...

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]: ...

    def closing(self, lasts: list[StrOutput]) -> list[dict[str, Any]]: ...


class EventStream(StreamingResponse):
    """An event stream written by the route's own task, a listener task watching for the
    client to leave (which cancels the writing, and so closes the request's streams: the
    abort). Starlette writes a stream from a new task: it starts behind every task that became
    ready meanwhile, and with four image chats at once the first one's first token waited there
    while the loop parsed the others' bodies."""

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        listen = functools.partial(self.listen_for_disconnect, receive)
        await cancel_when(listen, self.stream_response(send))  # a client that left: no more
        if self.background is not None:
            await self.background()


def event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def error_event(err: APIError) -> bytes:
    return event(err.body())


async def sse(
    writer: StreamWriter,
    firsts: list[StrOutput],
    streams: list[AsyncIterator[StrOutput]],
    usage: UsageRecorder,
    n: int = 1,
) -> AsyncIterator[bytes]:
    """Events for the outputs of one request's streams (one per prompt, each with n choices:
    prompt i's choice j is `index` i * n + j in the chunks); an error finish becomes an error
    event before `[DONE]` (no usage then); every stream is closed (which aborts its request)
    however it ends."""
    lasts: dict[int, StrOutput] = {}  # each choice's latest output
    try:
        for payload in writer.opening(firsts):
            yield event(payload)
        for stream_index, first in enumerate(firsts):
            lasts[stream_index * n + first.index] = first
            for payload in writer.chunks(first, stream_index * n + first.index):
                yield event(payload)
        async for stream_index, out in merged(streams):
            index = stream_index * n + out.index
            lasts[index] = out
            err = finish_error(out)
            if err is not None:
                yield error_event(err)
                yield DONE
                return
            for payload in writer.chunks(out, index):
                yield event(payload)
        finals = [lasts[i] for i in sorted(lasts)]
        usage.record(finals)
        for payload in writer.closing(finals):
            yield event(payload)
        yield DONE
    finally:
        for stream in streams:
            await stream.aclose()
