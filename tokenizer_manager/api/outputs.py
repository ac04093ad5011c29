"""Reading a request's outputs: the first one (so a refusal is an HTTP error before any stream
starts), all of them, and what an error finish means to the client."""

from __future__ import annotations

from collections.abc import AsyncIterator

from runtime.io_struct import StrOutput
from tokenizer_manager.protocol import APIError


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
