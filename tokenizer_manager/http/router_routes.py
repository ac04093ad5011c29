"""What sglang-router asks of a worker besides the APIs (docs/deployment.md, "Behind
sglang-router"): who the worker is (`/model_info`, the identity keys of `/server_info`), how
loaded it is (`/get_load`) and whether its model answers (`/health_generate`). Every number comes
from the scheduler's one `ServerInfo`; nothing here counts anything itself."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from runtime.io_struct import ServerInfo
from runtime.sampling_params import SamplingParams
from tokenizer_manager.api.base import model_name
from tokenizer_manager.protocol import APIError
from tokenizer_manager.tokenizer_manager import GenerateInput, TokenizerManager

HEALTH_PROMPT = "ping"  # what /health_generate asks the model to continue, for one token


def add_router_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def info() -> dict[str, Any]:
        return model_info(tm)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [load(info) for info in await tm.server_infos()]

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once one greedy token came back through the scheduler within
        --health-stall-timeout seconds; 503 otherwise (also while shutting down or overloaded)."""
        answered = await generates(tm, tm.args.health_stall_timeout)
        return Response(status_code=200 if answered else 503)


def worker_identity(tm: TokenizerManager) -> dict[str, Any]:
    """The keys of SGLang's /server_info the router registers a worker by: its model id is
    `served_model_name`; `dp_size` is how many data-parallel ranks it may address."""
    return {
        "model_path": tm.args.model_path,
        "tokenizer_path": tm.args.model_path,
        "served_model_name": model_name(tm),
        "dp_size": tm.args.dp_size,
    }


def model_info(tm: TokenizerManager) -> dict[str, Any]:
    """/model_info in SGLang's shape: a generative model that understands images."""
    raw = tm.config.raw
    return worker_identity(tm) | {
        "is_generation": True,
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "has_image_understanding": True,
        "has_audio_understanding": False,
        "weight_version": "default",
    }


def load(info: ServerInfo) -> dict[str, int]:
    """/get_load's entry for one data-parallel rank (a replica: its entry rank's counters).
    `num_tokens`, what the router balances by, is the KV the requests hold: neither free nor
    evictable cache."""
    return {
        "dp_rank": info.replica,
        "num_reqs": info.running + info.waiting,
        "num_waiting_reqs": info.waiting,
        "num_tokens": info.kv_total - info.kv_free - info.kv_evictable,
    }


async def generates(tm: TokenizerManager, timeout: float) -> bool:
    """Whether one greedy token of HEALTH_PROMPT comes back within `timeout` seconds. The
    request takes the path every request takes; when the deadline passes it is aborted."""
    inp = GenerateInput(
        f"health-generate-{uuid.uuid4().hex}",
        False,
        lambda room: SamplingParams(temperature=0.0, max_new_tokens=1),
        1,
        text=HEALTH_PROMPT,
    )
    try:
        return await asyncio.wait_for(_one_token(tm, inp), timeout)
    except (TimeoutError, asyncio.TimeoutError, APIError):
        return False


async def _one_token(tm: TokenizerManager, inp: GenerateInput) -> bool:
    """Read the request to its end (so it leaves the TokenizerManager at once): finished
    without an error."""
    last = None
    async for out in tm.generate(await tm.tokenize_request(inp)):
        last = out
    return last is not None and last.finish_reason is not None and not last.finish_reason.is_error
