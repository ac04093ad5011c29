"""The HTTP app (FastAPI), served in the main process by the TokenizerManager. It only routes:
each API lives in `tokenizer_manager/api/` (parsing and the internal request there, the SSE
writer and usage recorder shared); here are the routes, the API key, the error handlers and the
cancellation of a request whose client went away."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from runtime.allocator import frozen_startup_objects
from runtime.io_struct import ServerInfo
from runtime.logging_utils import get_logger
from runtime.model_config import GenerationDefaults
from tokenizer_manager.api.base import ApiContext, model_name
from tokenizer_manager.api.body import parse_body, validation_error
from tokenizer_manager.api.chat import ChatServing
from tokenizer_manager.api.completions import CompletionServing
from tokenizer_manager.api.errors import (
    InternalErrorGuard,
    count_internal_error,
    internal_error,
)
from tokenizer_manager.api.generate import GenerateServing
from tokenizer_manager.api.outputs import cancel_when
from tokenizer_manager.api.tokenize import DetokenizeServing, TokenizeServing
from tokenizer_manager.api.usage import ApiCounters, UsageRecorder
from tokenizer_manager.http.router_routes import add_router_routes, worker_identity
from tokenizer_manager.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenizer_manager.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    now,
)
from tokenizer_manager.tokenizer_manager import TokenizerManager

logger = get_logger(__name__)

DISCONNECT_POLL = 0.5  # seconds between checks that the client is still there
SESSION_HEADER = "x-session-id"  # a client session's requests keep to one replica (--dp)


def create_app(tm: TokenizerManager) -> FastAPI:
    auth = [Depends(api_key_check(tm.args.api_key))] if tm.args.api_key else []
    app = FastAPI(title="tessera", docs_url=None, redoc_url=None, dependencies=auth)
    app.state.tm = tm
    app.state.counters = ApiCounters()
    defaults = GenerationDefaults.load(tm.args.model_path, tm.args.generation_config)
    logger.info("sampling defaults in force: %s", defaults.in_force() or "tessera's own")
    ctx = ApiContext(
        UsageRecorder(app.state.counters), defaults, reasoning_parser=tm.args.reasoning_parser
    )
    install_error_handlers(app)
    add_info_routes(app, tm)
    add_router_routes(app, tm)
    add_api_route(app, "/v1/chat/completions", ChatCompletionRequest, ChatServing(tm, ctx))
    add_api_route(app, "/v1/completions", CompletionRequest, CompletionServing(tm, ctx))
    add_api_route(app, "/generate", GenerateRequest, GenerateServing(tm, ctx))
    add_api_route(app, "/tokenize", TokenizeRequest, TokenizeServing(tm, ctx))
    add_api_route(app, "/detokenize", DetokenizeRequest, DetokenizeServing(tm, ctx))
    return app


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        counters = app.state.counters
        if exc.status >= 500:
            counters.server_errors += 1
        else:
            counters.client_errors += 1
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        app.state.counters.client_errors += 1
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(Exception)
    async def on_internal(request: Request, exc: Exception) -> Response:
        """The backstop behind `InternalErrorGuard` (a failure of the guard itself). Starlette
        calls it with a request that has no receive channel: it must not read the request."""
        count_internal_error(app.state.counters, request.url.path, exc)
        return error_response(internal_error(exc))

    app.add_middleware(InternalErrorGuard, counters=app.state.counters)  # added last: outermost


def api_key_check(api_keys: tuple[str, ...]) -> Callable[[Request], None]:
    """A dependency that every route but /health runs: the bearer token, compared in constant
    time with every key; the caller's media scope (`media_scope`) is the key it presented. A
    dependency (not a middleware) leaves the client's disconnect visible to the route."""
    expected = [f"Bearer {key}".encode() for key in api_keys]

    def check(request: Request) -> None:
        if request.url.path == "/health":
            return
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if not any([hmac.compare_digest(given, e) for e in expected]):  # a list: no early exit
            raise APIError(
                "invalid or missing API key",
                status=401,
                code="invalid_api_key",
                type="authentication_error",
            )
        request.state.media_scope = media_scope(given)

    return check


def media_scope(credentials: bytes) -> str:
    """The scope of a caller's client media ids: a digest of the key it presented (the key
    itself is never kept). Without --api-key every caller shares the scope ""."""
    return hashlib.sha256(b"tessera media scope\0" + credentials).hexdigest()[:32]


def add_info_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.get("/health")
    async def health() -> Response:
        """503 when requests are in flight and no output came back for a while; with --dp,
        only when no replica serves (one that is down or restarting is named in
        /server_info's replicas)."""
        return Response(status_code=200 if tm.healthy() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name(tm),
            "object": "model",
            "created": now(),
            "owned_by": "tessera",
            "max_model_len": tm.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        infos = await tm.server_infos()
        return {
            "model": model_name(tm),
            **worker_identity(tm),
            "tp_size": tm.args.tp_size,
            "dp_size": tm.args.dp_size,
            "dp_policy": tm.args.dp_policy,
            "mm_enable_dp_encoder": tm.args.mm_enable_dp_encoder,
            "mm_encoder_mode": tm.args.mm_encoder_mode,
            **{k: v for k, v in asdict(ServerInfo.total(infos)).items() if k != "replica"},
            "replicas": tm.replicas_info(infos),
            "media": tm.media_info(),
            "grammar": tm.grammar.info(),
            "api": vars(app.state.counters) | {"in_flight": len(tm.states)},
            "main_gc_frozen": frozen_startup_objects(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        api = dict(vars(app.state.counters))
        text = tm.metrics.render(await tm.server_infos(), api)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        out = await tm.flush_cache()
        return JSONResponse(
            {"success": out.success, "message": out.message},
            status_code=200 if out.success else 409,
        )


class Handler(Protocol):
    async def handle(
        self, req: Any, arrival: float, scope: str = "", session: str | None = None
    ) -> Response: ...


def add_api_route(app: FastAPI, path: str, model: type, serving: Handler) -> None:
    """POST `path`: the body parsed as `model`, served by `serving` until the client leaves."""

    async def route(request: Request) -> Response:
        app.state.counters.requests += 1
        req = await parse_body(request, model)
        scope = getattr(request.state, "media_scope", "")
        session = request.headers.get(SESSION_HEADER) or None
        work = serving.handle(req, request.state.arrival, scope, session)
        return await until_disconnect(request, work)

    app.add_api_route(path, route, methods=["POST"], name=path)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a route's work in the route's own task (`cancel_when`); when the client goes away
    first, cancel it, which aborts the request (TokenizerManager.generate sends the abort as its
    generator closes). Logged, not an error."""
    left, response = await cancel_when(functools.partial(_client_gone, request), work)
    if left:
        logger.info("client disconnected from %s; request aborted", request.url.path)
        return Response(status_code=499)
    return response


async def _client_gone(request: Request) -> None:
    """Returns once the client has gone (checked every DISCONNECT_POLL seconds)."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL)
        if await request.is_disconnected():
            return
