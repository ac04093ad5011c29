"""A request's path to the scheduler and back takes no task hop: the route's work
(`until_disconnect`), a request with one stream (n = 1, one prompt: `first_outputs`) and its
event stream (`EventStream`) run in the route's own task, so the request reaches the scheduler,
and its first token the client, before the loop runs the other tasks that became ready
meanwhile (other requests' parsing). Several streams still run together, every stream is closed
when the work is cancelled, and a client that leaves still gets its request aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from runtime.io_struct import StrOutput
from tokenizer_manager.api.outputs import collect_all, first_outputs, merged
from tokenizer_manager.api.sse import EventStream
from tokenizer_manager.http import server as http_server
from tokenizer_manager.http.server import until_disconnect


def out(text: str, rid: str = "r1") -> StrOutput:
    return StrOutput(rid, text, [1], 3, 1, 0, None)


async def stream(log: list[str], name: str, *texts: str) -> AsyncIterator[StrOutput]:
    """What `TokenizerManager.generate` does: its first step sends the request (logged here
    with the task that ran it), then it yields what comes back."""
    log.append(f"{name} sent in {asyncio.current_task().get_name()}")
    try:
        for text in texts:
            await asyncio.sleep(0)
            yield out(text, name)
    finally:
        log.append(f"{name} closed")


def test_one_stream_is_sent_before_the_other_ready_tasks_run() -> None:
    log: list[str] = []

    async def route() -> list[StrOutput]:
        asyncio.current_task().set_name("route")
        # another request's step, ready before this one reads its stream
        asyncio.get_running_loop().call_soon(log.append, "another request's step")
        return await first_outputs([stream(log, "a", "x", "y")])

    firsts = asyncio.run(route())
    assert [o.text for o in firsts] == ["x"]
    assert log[:2] == ["a sent in route", "another request's step"]


def test_several_streams_start_together_and_all_are_read() -> None:
    log: list[str] = []

    async def route() -> list[list[StrOutput]]:
        streams = [stream(log, "a", "a1", "a2"), stream(log, "b", "b1")]
        firsts = await first_outputs(streams)
        return await collect_all(firsts, streams)

    per_stream = asyncio.run(route())
    assert [[o.text for o in outs] for outs in per_stream] == [["a1", "a2"], ["b1"]]
    assert sum("sent" in line for line in log) == 2
    assert sum("closed" in line for line in log) == 2


def test_one_stream_collects_in_order_and_closes() -> None:
    log: list[str] = []

    async def route() -> list[list[StrOutput]]:
        streams = [stream(log, "a", "1", "2", "3")]
        firsts = await first_outputs(streams)
        return await collect_all(firsts, streams)

    (outs,) = asyncio.run(route())
    assert [o.text for o in outs] == ["1", "2", "3"]
    assert log[-1] == "a closed"


def test_merged_reads_one_stream_in_order() -> None:
    log: list[str] = []

    async def read() -> list[tuple[int, str]]:
        return [(i, o.text) async for i, o in merged([stream(log, "a", "1", "2", "3")])]

    assert asyncio.run(read()) == [(0, "1"), (0, "2"), (0, "3")]


def test_a_cancelled_wait_for_the_first_output_closes_the_one_stream() -> None:
    """A client that leaves before its first token cancels the route: the request's stream
    runs its cleanup (in tessera, the abort to the scheduler)."""
    log: list[str] = []

    async def waiting() -> AsyncIterator[StrOutput]:
        try:
            log.append("sent")
            await asyncio.Event().wait()
            yield out("never")
        finally:
            log.append("closed")

    async def route() -> None:
        task = asyncio.ensure_future(first_outputs([waiting()]))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            log.append("cancelled")

    asyncio.run(route())
    assert log == ["sent", "closed", "cancelled"]


class Connection:
    """A request whose client leaves after `polls` checks (never: None)."""

    url = SimpleNamespace(path="/v1/chat/completions")

    def __init__(self, polls: int | None = None) -> None:
        self.polls = polls

    async def is_disconnected(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


def test_the_work_runs_in_the_route_task_before_other_ready_tasks() -> None:
    log: list[str] = []

    async def work() -> str:
        log.append(f"work in {asyncio.current_task().get_name()}")
        return "response"

    async def route() -> str:
        asyncio.current_task().set_name("route")
        asyncio.get_running_loop().call_soon(log.append, "another request's step")
        return await until_disconnect(Connection(), work())

    assert asyncio.run(route()) == "response"
    assert log == ["work in route", "another request's step"]


def test_a_client_that_leaves_gets_499_and_its_stream_closed(monkeypatch) -> None:
    monkeypatch.setattr(http_server, "DISCONNECT_POLL", 0.01)
    log: list[str] = []

    async def endless() -> AsyncIterator[StrOutput]:
        try:
            yield out("a")
            await asyncio.Event().wait()
            yield out("never")
        finally:
            log.append("closed")

    async def work() -> str:
        streams = [endless()]
        firsts = await first_outputs(streams)
        await collect_all(firsts, streams)
        return "response"

    async def route() -> object:
        response = await until_disconnect(Connection(polls=2), work())
        await asyncio.sleep(0)  # the route goes on: no cancellation is left pending
        return response

    response = asyncio.run(route())
    assert response.status_code == 499 and log == ["closed"]


def test_a_route_cancelled_from_outside_is_cancelled(monkeypatch) -> None:
    """Cancelling the route (the server stopping) is not a client that left: it propagates."""
    monkeypatch.setattr(http_server, "DISCONNECT_POLL", 0.01)

    async def main() -> None:
        route = asyncio.ensure_future(until_disconnect(Connection(), asyncio.Event().wait()))
        await asyncio.sleep(0.05)
        route.cancel()
        with pytest.raises(asyncio.CancelledError):
            await route

    asyncio.run(main())


SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


async def client_stays() -> dict:
    await asyncio.Event().wait()
    return {}


def test_an_event_stream_writes_its_first_chunk_before_other_ready_tasks() -> None:
    log: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        await asyncio.sleep(0)
        yield b"data: second\n\n"

    async def send(message: dict) -> None:
        log.append(message["type"] + ":" + message.get("body", b"").decode().strip())

    async def route() -> None:
        asyncio.get_running_loop().call_soon(log.append, "another request's step")
        await EventStream(body())(SCOPE, client_stays, send)
        await asyncio.sleep(0)  # no cancellation left pending

    asyncio.run(route())
    assert log == [
        "http.response.start:",
        "http.response.body:data: first",
        "another request's step",
        "http.response.body:data: second",
        "http.response.body:",
    ]


def test_a_client_that_leaves_mid_stream_closes_the_stream() -> None:
    log: list[str] = []
    sent: list[dict] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()
            yield b"never"
        finally:
            log.append("closed")

    async def leaves() -> dict:
        await asyncio.sleep(0.02)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def route() -> None:
        await EventStream(endless())(SCOPE, leaves, send)
        await asyncio.sleep(0)  # the route goes on: no cancellation is left pending
        log.append("route done")

    asyncio.run(route())
    assert log == ["closed", "route done"]
    assert [m.get("body") for m in sent[1:]] == [b"data: first\n\n"]


def test_an_event_stream_cancelled_from_outside_is_cancelled() -> None:
    async def endless() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        pass

    async def main() -> None:
        task = asyncio.ensure_future(EventStream(endless())(SCOPE, client_stays, send))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
