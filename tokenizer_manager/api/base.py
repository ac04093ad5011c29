"""The steps every API takes (SGLang-style serving classes): convert the parsed request into a
`GenerateInput`, tokenize, run, then build the response or hand a `StreamWriter` to the one SSE
writer. An API module only says how its request becomes a `GenerateInput` and how outputs become
its response."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from fastapi.responses import JSONResponse, Response

from runtime.io_struct import StrOutput
from runtime.model_config import GenerationDefaults
from runtime.sampling_params import SamplingParams
from tokenizer_manager.api.fields import UnknownFields, route_of
from tokenizer_manager.api.outputs import collect_all, first_outputs
from tokenizer_manager.api.sse import EventStream, StreamWriter, sse
from tokenizer_manager.api.usage import UsageRecorder
from tokenizer_manager.protocol import APIError
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager

R = TypeVar("R")


def model_name(tm: TokenizerManager) -> str:
    return tm.args.served_model_name or Path(tm.args.model_path).name


# sglang-router's stand-in for a request that names no model (it forwards every request with one)
ROUTER_NO_MODEL = "unknown"


def check_model(tm: TokenizerManager, name: str | None) -> None:
    if name not in (None, "", ROUTER_NO_MODEL, model_name(tm), tm.args.model_path):
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


@dataclass
class ApiContext:
    """What every API shares: the usage recorder, the checkpoint's sampling defaults and the
    record of unknown fields already warned about."""

    usage: UsageRecorder
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    unknown: UnknownFields = field(default_factory=UnknownFields)
    reasoning_parser: str | None = None  # --reasoning-parser


def by_choice(outputs: list[StrOutput], n: int) -> list[list[StrOutput]]:
    """An engine request's outputs per choice, in order (its n choices interleave)."""
    choices: list[list[StrOutput]] = [[] for _ in range(n)]
    for out in outputs:
        choices[out.index].append(out)
    return choices


class Serving(ABC, Generic[R]):
    """One API: request `R` in, a JSON response or an SSE stream out."""

    def __init__(self, tm: TokenizerManager, ctx: ApiContext) -> None:
        self.tm = tm
        self.ctx = ctx
        self.usage = ctx.usage

    async def handle(
        self, req: R, arrival: float, scope: str = "", session: str | None = None
    ) -> Response:
        """`scope`: the caller's media scope (client media ids are its own); `session`: the
        client's session header (its requests keep to one replica)."""
        route = route_of(req, session, self.tm.args.dp_size)
        rid, inputs = self.to_inputs(req)
        for inp in inputs:
            inp.media_scope = scope
        tokenized = [await self.tm.tokenize_request(inp) for inp in inputs]  # all checked first
        streams = [self.tm.generate(t, arrival, route) for t in tokenized]
        firsts = await first_outputs(streams)
        n = tokenized[0].sampling_params.n
        if inputs[0].stream:
            body = sse(self.stream_writer(rid, req), firsts, streams, self.usage, n)
            return EventStream(body)
        per_request = await collect_all(firsts, streams)
        choices = [c for outputs in per_request for c in by_choice(outputs, n)]
        self.usage.record([outputs[-1] for outputs in choices])
        return JSONResponse(self.response(rid, req, choices))

    def to_inputs(self, req: R) -> tuple[str, list[GenerateInput]]:
        """The response's id and one internal request per prompt (or choice)."""
        inp = self.to_input(req)
        return inp.rid, [inp]

    def to_input(self, req: R) -> GenerateInput:
        """Validate the request and convert it to the internal request (400s name the field);
        an API that makes several overrides `to_inputs` instead."""
        raise NotImplementedError

    @abstractmethod
    def stream_writer(self, rid: str, req: R) -> StreamWriter:
        """How this API streams the request's outputs."""

    @abstractmethod
    def response(self, rid: str, req: R, choices: list[list[StrOutput]]) -> dict[str, Any]:
        """The JSON response; `choices` holds each choice's outputs, in order (prompt i's
        choice j at i * n + j)."""
