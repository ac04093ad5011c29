"""An error finish reaches the client as an error, never as finish_reason "stop" (issue 10):
5xx OpenAI error JSON when not streaming, an error event before [DONE] when streaming."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from runtime.io_struct import Finish, StrOutput
from tokenizer_manager.api.chat import ChatStream
from tokenizer_manager.api.generate import NativeStream
from tokenizer_manager.api.openai_common import Envelope
from tokenizer_manager.api.outputs import collect_until_done, first_output
from tokenizer_manager.api.sse import sse
from tokenizer_manager.api.usage import ApiCounters, UsageRecorder
from tokenizer_manager.http.server import until_disconnect
from tokenizer_manager.protocol import APIError

FAULT = Finish.error("request fault on TP rank 1", 500, "x")


def out(text: str, finish: Finish | None = None) -> StrOutput:
    return StrOutput("r1", text, [1], 3, 1, 0, finish)


async def outputs(*items: StrOutput) -> AsyncIterator[StrOutput]:
    for item in items:
        yield item


async def drain(body: AsyncIterator[bytes]) -> list[str]:
    return [chunk.decode() async for chunk in body if chunk]


def test_stream_gets_an_error_event_before_done() -> None:
    envelope = Envelope("r1", "m", "chat.completion", "chat.completion.chunk")
    writer = ChatStream(envelope, (True, False))
    stream = outputs(out("b"), out("", FAULT))
    body = sse(writer, [out("a")], [stream], UsageRecorder(ApiCounters()))
    events = asyncio.run(drain(body))
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["message"] == FAULT.detail and error["error"]["code"] == "x"
    assert not any('"finish_reason": "stop"' in e for e in events)
    assert not any('"usage"' in e for e in events)


def test_native_stream_gets_an_error_event_before_done() -> None:
    stream = outputs(out("", FAULT))
    body = sse(NativeStream("r1"), [out("a")], [stream], UsageRecorder(ApiCounters()))
    events = asyncio.run(drain(body))
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "internal_server_error"


def test_non_streaming_error_finish_raises_a_5xx() -> None:
    with pytest.raises(APIError) as info:
        asyncio.run(collect_until_done(out("a"), outputs(out("", FAULT))))
    assert info.value.status == 500 and info.value.body()["error"]["code"] == "x"


class Disconnected:
    url = SimpleNamespace(path="/v1/chat/completions")

    async def is_disconnected(self) -> bool:
        return True


def test_a_client_that_leaves_mid_request_gets_its_stream_closed() -> None:
    """The route's work is cancelled (no generator is closed while it runs: that raised
    RuntimeError, a 500), the stream's cleanup (the abort) runs, and the answer is 499."""
    cleaned = []

    async def endless() -> AsyncIterator[StrOutput]:
        try:
            yield out("b")
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    async def work() -> None:
        stream = endless()
        first = await first_output(stream)
        await collect_until_done(first, stream)

    response = asyncio.run(until_disconnect(Disconnected(), work()))
    assert response.status_code == 499 and cleaned == [True]


def test_a_client_that_leaves_while_waiting_gets_its_stream_closed() -> None:
    cleaned = []

    async def silent() -> AsyncIterator[StrOutput]:
        try:
            await asyncio.Event().wait()
            yield out("never")
        finally:
            cleaned.append(True)

    async def work() -> None:
        await first_output(silent())

    response = asyncio.run(until_disconnect(Disconnected(), work()))
    assert response.status_code == 499 and cleaned == [True]
