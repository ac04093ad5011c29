"""The steps every API takes (SGLang-style serving classes): convert the parsed request into a
`GenerateInput`, tokenize, run, then build the response or hand a `StreamWriter` to the one SSE
writer. An API module only says how its request becomes a `GenerateInput` and how outputs become
its response."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Generic, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.io_struct import StrOutput
from runtime.sampler import SamplingParams
from tokenizer_manager.api.outputs import collect_until_done, first_output
from tokenizer_manager.api.sse import StreamWriter, sse
from tokenizer_manager.api.usage import UsageRecorder
from tokenizer_manager.protocol import APIError
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager

R = TypeVar("R")


def model_name(tm: TokenizerManager) -> str:
    return tm.args.served_model_name or Path(tm.args.model_path).name


def check_model(tm: TokenizerManager, name: str | None) -> None:
    if name not in (None, "", model_name(tm), tm.args.model_path):
        raise APIError(
            f"model {name!r} is not served here; this server serves {model_name(tm)!r}",
            param="model",
            code="model_not_found",
        )


def checked(params: SamplingParams) -> SamplingParams:
    """The params normalized, or a 400 naming what is wrong."""
    try:
        params.normalize()
    except ValueError as e:
        raise APIError(str(e), code="invalid_sampling_params") from e
    return params


def by_choice(outputs: list[StrOutput], n: int) -> list[list[StrOutput]]:
    """Each choice's outputs, in order (a request's n choices interleave)."""
    choices: list[list[StrOutput]] = [[] for _ in range(n)]
    for out in outputs:
        choices[out.index].append(out)
    return choices


class Serving(ABC, Generic[R]):
    """One API: request `R` in, a JSON response or an SSE stream out."""

    def __init__(self, tm: TokenizerManager, usage: UsageRecorder) -> None:
        self.tm = tm
        self.usage = usage

    async def handle(self, req: R, arrival: float) -> Response:
        inp = self.to_input(req)
        tokenized = await self.tm.tokenize_request(inp)
        stream = self.tm.generate(tokenized, arrival)
        first = await first_output(stream)
        if inp.stream:
            body = sse(self.stream_writer(tokenized.rid, req), first, stream, self.usage)
            return StreamingResponse(body, media_type="text/event-stream")
        outputs = await collect_until_done(first, stream)
        choices = by_choice(outputs, tokenized.sampling_params.n)
        self.usage.record([c[-1] for c in choices])
        return JSONResponse(self.response(tokenized.rid, req, choices))

    @abstractmethod
    def to_input(self, req: R) -> GenerateInput:
        """Validate the request and convert it to the internal request (400s name the field)."""

    @abstractmethod
    def stream_writer(self, rid: str, req: R) -> StreamWriter:
        """How this API streams the request's outputs."""

    @abstractmethod
    def response(self, rid: str, req: R, choices: list[list[StrOutput]]) -> dict[str, Any]:
        """The JSON response; `choices` holds each choice's outputs, in order."""
