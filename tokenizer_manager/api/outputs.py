"""Reading a request's outputs: the first one (so a refusal is an HTTP error before any stream
starts), all of them, and what an error finish means to the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from runtime.io_struct import StrOutput
from tokenizer_manager.protocol import APIError

T = TypeVar("T")


async def first_output(stream: AsyncIterator[StrOutput]) -> StrOutput:
    """The first output, so a refusal or a fault becomes an HTTP error before any stream starts.
    (A client that leaves while its request waits cancels the route: see until_disconnect.)"""
    first = await anext(stream)
    err = finish_error(first)
    if err is not None:
        await stream.aclose()
        raise err
    return first


def finish_error(out: StrOutput) -> APIError | None:
    """The client's error for an error finish: 400 for a refusal, 5xx for a fault."""
    finish = out.finish_reason
    if finish is None or not finish.is_error:
        return None
    status = finish.status or 500
    return APIError(
        finish.detail or "the request failed",
        status=status,
        param=finish.param,
        code=finish.code or ("request_refused" if status < 500 else "internal_error"),
    )


async def collect_until_done(first: StrOutput, stream: AsyncIterator[StrOutput]) -> list[StrOutput]:
    """Gather all outputs. A client that disconnects cancels this (until_disconnect), and the
    request's generator sends the abort as it closes."""
    outputs = [first]
    try:
        async for out in stream:  # ends after the last choice's finish
            outputs.append(out)
    finally:
        await stream.aclose()
    for out in outputs:
        err = finish_error(out)
        if err is not None:
            raise err
    return outputs


def finish_reason(out: StrOutput) -> str | None:
    """OpenAI's finish_reason of an output (None until the last one)."""
    if out.finish_reason is None:
        return None
    return out.finish_reason.kind.value  # errors never get here: see finish_error


async def cancel_when(
    watch: Callable[[], Awaitable[object]], work: Awaitable[T]
) -> tuple[bool, T | None]:
    """Run `work` in this task while `watch()` runs in a task of its own; when the watch ends
    first, the work is cancelled and (True, None) comes back, else (False, its result). A cancel
    from outside still propagates. The work stays in this task because a new task starts behind
    every task that became ready meanwhile (other requests' body reads and parses)."""
    task = asyncio.current_task()
    assert task is not None  # a coroutine run by asyncio
    fired: list[bool] = []

    async def watcher() -> None:
        await watch()
        fired.append(True)
        task.cancel()

    watching = asyncio.ensure_future(watcher())
    try:
        return False, await work
    except asyncio.CancelledError:
        if not fired or task.cancelling() > 1:
            raise  # cancelled from outside as well
        task.uncancel()
        return True, None
    finally:
        watching.cancel()


async def closing_one(stream: AsyncIterator[StrOutput], work: Awaitable[T]) -> T:
    """`closing_all` for one stream, in this task."""
    try:
        return await work
    except BaseException:
        await stream.aclose()
        raise


async def closing_all(streams: list[AsyncIterator[StrOutput]], work: list[Awaitable[T]]) -> list[T]:
    """Run `work` (one awaitable per stream) together; if any fails or this is cancelled, the
    rest is cancelled and every stream closed (each open request is aborted), then it raises."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise


async def first_outputs(streams: list[AsyncIterator[StrOutput]]) -> list[StrOutput]:
    """The first output of each stream (started together). One stream (n = 1, one prompt: most
    requests) is read in this task: a new task per stream starts behind every task that became
    ready meanwhile, so a request sent the scheduler its message only once the loop had also
    run the other requests' steps (4 ms later for an image chat arriving with three others)."""
    if len(streams) == 1:
        return [await closing_one(streams[0], first_output(streams[0]))]
    return await closing_all(streams, [first_output(s) for s in streams])


async def collect_all(
    firsts: list[StrOutput], streams: list[AsyncIterator[StrOutput]]
) -> list[list[StrOutput]]:
    """Every stream's outputs, gathered together (one stream: in this task)."""
    work = [collect_until_done(f, s) for f, s in zip(firsts, streams)]
    if len(streams) == 1:
        return [await closing_one(streams[0], work[0])]
    return await closing_all(streams, work)


async def merged(streams: list[AsyncIterator[StrOutput]]) -> AsyncIterator[tuple[int, StrOutput]]:
    """(stream index, output) as they come from any stream; each stream's order is kept. One
    stream is read directly: no task and no wait per output."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                if isinstance(task.exception(), StopAsyncIteration):
                    continue
                yield i, task.result()
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
