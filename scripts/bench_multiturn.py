"""Multi-turn chat as clients send it: every turn resends the whole conversation, images included.

    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --preset vit-heavy --out /tmp/vit-heavy
    python scripts/bench_multiturn.py --model-path /tmp/vit-heavy --json multiturn.json
    python scripts/bench_multiturn.py --hash-only          # XXH3-128 against SHA-256 only
    python scripts/bench_multiturn.py --model-path DIR --frontend-only   # media front end only

Starts one `launch.py` per configuration (default: the processed-item cache on, and off with
`--mm-processor-cache-gb 0`). On each: `--conversations` conversations (4) run at once, each of
`--turns` turns (6); the first user message holds 2 images (`--image-size`, PNG data: URLs, new
ones per conversation) and a question, every later turn appends the model's answer and a short
question and resends everything. Turns go in waves (every conversation's turn k, then k + 1), and
around each wave the benchmark reads from /proc the CPU seconds of the server's main process
(HTTP, TokenizerManager, the cache) and of its media worker processes (the children the launcher
did not log as its own), and from /server_info the pixel bytes sent to the ranks. Alongside, as
many text-only conversations run the same turns with filler words in place of the images, so
their cached prefix has the same length: their time to first token is the floor a turn with
cached images can reach.

First, without a server, the media front end alone (this process and its media workers) runs 8
new images one at a time and then the same 8 again: CPU per image on a miss and on a hit. /proc
counts CPU in 10 ms ticks: use enough images of a real size for the per-turn columns to mean
anything (the smoke setting of the tests does not).

A third set of conversations sends the same kind of images with a client media id (`uuid`) on
each part, and from the second turn on the ids without the bytes (`ids_vs_text`: its time to first
token against the text-only one).

Per configuration and turn it prints the median time to first token of the image and of the
text-only conversations and their ratio, the main-process and media-worker CPU per image (and,
to tell the images' share from a request's own, the main-process CPU per text-only request), and
the pixel MB sent to the ranks; the speed-up of the cache is the "off" row against the "on" row.
`new_tokens` and `text_new_tokens` are what each side prefilled (the prompt less the cached
tokens of its usage): the comparison holds while they are alike, which is why every text
conversation starts with a tag of its own (`text_conversations`).

Where a turn's time goes: a wave's bodies are all encoded before any of its clocks starts (a
client encoding the other conversations' 1.6 MB bodies in the same event loop once added ~15 ms
to the median; the chat requests go through aiohttp, which spends less than half httpx's CPU
sending them: `chat_session`), and a second table gives, per turn, image request / text-only
request, the client's upload (start to the body handed to the connection) and the mean ms per
request of every stage the server reports in /metrics (`tessera_request_stage_seconds`: receive,
parse, template, tokenize, media, build, send = arrival to the scheduler, queue, encoder,
prefill, first_token).

On a machine others load, `--rounds N` starts every configuration's server at once (idle
servers sleep) and runs N rounds; each round runs every configuration's conversations (new
images each round), in an order that rotates from round to round, so the configurations share
the machine's load alike. The summary is the median over the rounds of each (configuration,
turn) row, with the 1-minute load average seen while the rows were measured.

`--routing`: the data-parallel routing benchmark (issue 55). Each setup runs in turn (started,
measured, stopped: at most two replicas are up at a time): tessera `--dp 1` (the reference
for the cached share), `--dp 2` under each `--dp-policy`, and sglang-router `--policy
cache_aware` in front of two `--dp 1` servers (`--routing-setups` picks some; `router_pinned`,
only when named, pins those two servers to half the CPUs each, as `--dp 2` splits them). On each,
`--conversations` conversations run at once, each of `--turns` turns that resend its 2 images,
while `--single-turn` unrelated one-turn chats with new images go one after another. Per setup:
the cached share of the prompt tokens (usage `prompt_tokens_details.cached_tokens`), time to
first token p50 and p99 of the conversations and of the single turns, requests per second, and
the busiest over the least busy replica's request count (tessera's `/server_info`
`replicas[*].routed`, each router worker's own, counted after the warm-up); then the targets:
the cached share against `--dp 1`'s and the conversations' p50 against the router's. With
`--rounds N` the setups run N times in an order that rotates, new images each round; the summary
is each setup's medians (the request counts summed).

    python scripts/bench_multiturn.py --routing --model-path DIR --conversations 6 --turns 4 \
        --single-turn 12 --image-size 224 --json routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import httpx
import numpy as np
from bench_vs_vllm import (
    STARTED_CHILD,
    Server,
    free_port,
    proc_stat,
    process_tree,
    tessera_server,
)
from PIL import Image

from runtime.cpus import rank_cpus
from tokenizer_manager.dispatcher import POLICIES as DP_POLICIES

DEFAULT_SERVERS = ["cache-on=--tp 1", "cache-off=--tp 1 --mm-processor-cache-gb 0"]
QUESTIONS = ["Describe both images.", "And the colours?", "Which is brighter?", "Why?", "Sure?"]
FILLER = " picture"


# ---------------------------------------------------------------- requests


def image_url(rng: np.random.Generator, size: int) -> str:
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    images: int

    def ask(self, turn: int) -> None:
        if turn:
            self.messages.append({"role": "user", "content": QUESTIONS[(turn - 1) % 5]})
        if turn == 1:  # a client with media ids sends the bytes once, then the ids alone
            for part in self.messages[0]["content"]:
                if "uuid" in part:
                    part.pop("image_url")


def image_conversation(
    rng: np.random.Generator, size: int, ids: bool = False
) -> Conversation:
    """2 new images and a question; `ids`: each image part carries a client `uuid`, and the
    conversation resends the ids without the bytes from its second turn."""
    parts = [{"type": "image_url", "image_url": {"url": image_url(rng, size)}} for _ in range(2)]
    if ids:
        prefix = f"bench-{rng.integers(1 << 62):x}"
        parts = [part | {"uuid": f"{prefix}-{j}"} for j, part in enumerate(parts)]
    content = [*parts, {"type": "text", "text": "Look at these two images."}]
    return Conversation([{"role": "user", "content": content}], 2)


def text_conversation(words: int, tag: str = "") -> Conversation:
    """A text-only first turn of about `words` filler words. `tag` starts it: every text
    conversation gets its own, so that no two share a prefix in the cache (the image ones share
    none either: their images are new), nor one of an earlier round."""
    text = f"{tag}{FILLER * words} Look at these two images."
    return Conversation([{"role": "user", "content": text}], 0)


def text_conversations(words: int, seed: int, n: int) -> list[Conversation]:
    """The text-only side of a round: `n` conversations, each starting with its own tag (its
    round's seed and its number). Identical ones would share their prefix in the cache, with one
    another and with the last round's, and prefill a fraction of what the image turns do; each
    turn's text request must prefill what its image request does (`new_tokens`)."""
    return [text_conversation(words, f"Chat {seed}-{i}.") for i in range(n)]


@dataclass
class Api:
    session: aiohttp.ClientSession  # from `chat_session`: the chat requests go through it
    model: str
    max_tokens: int


def chat_session(base_url: str) -> aiohttp.ClientSession:
    """The client of the chat requests: aiohttp, as `bench_serving.py`'s. On this 2-core machine
    the client shares the cores with the server, and httpx spent 6.1-6.3 ms of CPU per request
    sending four 1.6 MB bodies at once against aiohttp's 2.7-2.8 (the same turn resent 15 times,
    full prefix hits): the difference landed in the image turns' time to first token (median
    29 against 24 ms) and not in the text turns' (small bodies). A client's own cost is not the
    server's time, as with the JSON encoding (`wave`). Each request's `trace_request_ctx` list
    gets the time its body was handed to the connection."""
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(_body_sent)
    timeout = aiohttp.ClientTimeout(total=600)
    return aiohttp.ClientSession(base_url, timeout=timeout, trace_configs=[trace])


async def get_json(session: aiohttp.ClientSession, path: str) -> Any:
    async with session.get(path) as resp:
        resp.raise_for_status()
        return await resp.json()


async def _body_sent(session: Any, ctx: Any, params: Any) -> None:
    ctx.trace_request_ctx.append(time.perf_counter())


def encode(api: Api, conv: Conversation) -> bytes:
    """The request body of the conversation's next turn."""
    body = {
        "model": api.model, "messages": conv.messages, "max_tokens": api.max_tokens,
        "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    return json.dumps(body).encode()


class Reply(NamedTuple):
    ttft_s: float  # seconds to the first token
    prompt_tokens: int
    upload_s: float  # seconds until this client had handed the body to the connection
    cached_tokens: int  # of the prompt, served from the prefix cache (usage.prompt_tokens_details)


async def turn(api: Api, conv: Conversation, payload: bytes | None = None) -> Reply:
    """One streamed request. The answer joins the conversation. The clock starts once the body
    (`payload`, else this turn's) is encoded: a client's own JSON encoding (10 ms for two
    448-pixel PNGs here) is not the server's time."""
    payload = encode(api, conv) if payload is None else payload
    headers = {"content-type": "application/json"}
    start, first, text, prompt, cached, sent = time.perf_counter(), None, [], 0, 0, []
    post = api.session.post(
        "/v1/chat/completions", data=payload, headers=headers, trace_request_ctx=sent
    )
    async with post as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for raw in resp.content:  # one line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") or 0
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    conv.messages.append({"role": "assistant", "content": "".join(text)})
    upload = (sent[-1] if sent else math.nan) - start
    return Reply((first or time.perf_counter()) - start, prompt, upload, cached)


# ---------------------------------------------------------------- server costs


def server_pids(server: Server) -> tuple[int, list[int]]:
    """The main process and the media workers: children the launcher did not log."""
    logged = {int(pid) for _, pid in STARTED_CHILD.findall(server.log.read_text())}
    main = server.proc.pid
    return main, [pid for pid in process_tree(main) if pid != main and pid not in logged]


def costs(server: Server, client: httpx.Client) -> dict[str, Any]:
    main, workers = server_pids(server)
    media = client.get("/server_info").json().get("media") or {}
    return {
        "main_cpu_s": proc_stat(main).cpu_s,
        "worker_cpu_s": sum(proc_stat(pid).cpu_s for pid in workers),
        "pixel_bytes": media.get("pixel_bytes_sent", 0),
        "stages": stage_totals(client.get("/metrics").text),
    }


STAGE_LINE = re.compile(r'^tessera_request_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', re.M)
STAGES = [
    "receive", "parse", "template", "tokenize", "media", "build", "send", "queue", "encoder",
    "prefill", "first_token",
]  # fmt: skip


def stage_totals(metrics: str) -> dict[tuple[str, str], float]:
    """(stage, "sum" or "count") -> value, from /metrics' stage histogram."""
    return {(stage, kind): float(v) for kind, stage, v in STAGE_LINE.findall(metrics)}


def stage_ms(before: dict, after: dict, prefix: str) -> dict[str, float]:
    """Mean milliseconds per request of every stage between two scrapes (`prefix` + stage)."""
    out = {}
    for stage in STAGES:
        count = after.get((stage, "count"), 0) - before.get((stage, "count"), 0)
        total = after.get((stage, "sum"), 0) - before.get((stage, "sum"), 0)
        out[f"{prefix}{stage}_ms"] = total * 1e3 / count if count else math.nan
    return out


# ---------------------------------------------------------------- one configuration


async def wave(api: Api, convs: list[Conversation], k: int) -> list:
    """Every conversation's turn k at once; the bodies are encoded before any clock starts, so
    no request's time counts the client's encoding of the others'."""
    for conv in convs:
        conv.ask(k)
    payloads = [encode(api, conv) for conv in convs]
    return await asyncio.gather(*(turn(api, c, p) for c, p in zip(convs, payloads)))


async def filler_words(api: Api, prompt_tokens: int) -> int:
    """Filler words that give a text-only first turn `prompt_tokens` tokens (one calibration
    request of 100 words, then proportion)."""
    tag = "Chat calibration."  # no benchmarked conversation starts with it
    base = (await turn(api, text_conversation(0, tag))).prompt_tokens
    per = ((await turn(api, text_conversation(100, tag))).prompt_tokens - base) / 100
    return max(0, round((prompt_tokens - base) / max(per, 1e-6)))


async def run_config(server: Server, args: argparse.Namespace, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    url = server.url
    async with chat_session(url) as session:
        model = (await get_json(session, "/v1/models"))["data"][0]["id"]
        api = Api(session, model, args.max_tokens)
        warm = image_conversation(np.random.default_rng(seed + 10_000), args.image_size)
        image_prompt = (await turn(api, warm)).prompt_tokens
        words = await filler_words(api, image_prompt)
        images = [image_conversation(rng, args.image_size) for _ in range(args.conversations)]
        texts = text_conversations(words, seed, args.conversations)
        media = (await get_json(session, "/server_info")).get("media") or {}
        ids = media.get("processed_cache") is not None  # ids need the processed-item cache
        by_id = [image_conversation(rng, args.image_size, True) for _ in range(args.conversations)]
        rows = []
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as sync:
            for k in range(args.turns):
                before = costs(server, sync)
                image_out = await wave(api, images, k)
                after = costs(server, sync)
                text_out = await wave(api, texts, k)
                text_cost = costs(server, sync)
                id_out = await wave(api, by_id, k) if ids else [Reply(math.nan, 0, 0.0, 0)]
                rows.append(row(server.name, k, image_out, text_out, before, after, images))
                text_main = (text_cost["main_cpu_s"] - after["main_cpu_s"]) * 1e3 / len(texts)
                rows[-1]["text_main_cpu_ms_per_request"] = text_main
                rows[-1]["ids_vs_text"] = statistics.median(r.ttft_s for r in id_out) / (
                    rows[-1]["text_ttft_ms"] / 1e3
                )
                rows[-1] |= stage_ms(before["stages"], after["stages"], "stage_")
                rows[-1] |= stage_ms(after["stages"], text_cost["stages"], "text_stage_")
                rows[-1]["load_avg"] = os.getloadavg()[0]
                print(line(rows[-1]), flush=True)
    return rows


def row(
    name: str, k: int, image_out: list, text_out: list, before: dict, after: dict, convs: list
) -> dict[str, Any]:
    images = sum(conv.images for conv in convs)
    ttft = statistics.median(r.ttft_s for r in image_out)
    text_ttft = statistics.median(r.ttft_s for r in text_out)
    return {
        "server": name, "turn": k + 1, "ttft_ms": ttft * 1e3, "text_ttft_ms": text_ttft * 1e3,
        "ttft_vs_text": ttft / text_ttft,
        "prompt_tokens": statistics.median(r.prompt_tokens for r in image_out),
        "text_prompt_tokens": statistics.median(r.prompt_tokens for r in text_out),
        # what each prefilled: its prompt less what the prefix cache served
        "new_tokens": statistics.median(r.prompt_tokens - r.cached_tokens for r in image_out),
        "text_new_tokens": statistics.median(r.prompt_tokens - r.cached_tokens for r in text_out),
        "upload_ms": statistics.median(r.upload_s for r in image_out) * 1e3,
        "text_upload_ms": statistics.median(r.upload_s for r in text_out) * 1e3,
        "main_cpu_ms_per_image": (after["main_cpu_s"] - before["main_cpu_s"]) * 1e3 / images,
        "worker_cpu_ms_per_image": (after["worker_cpu_s"] - before["worker_cpu_s"]) * 1e3 / images,
        "pixel_mb_to_ranks": (after["pixel_bytes"] - before["pixel_bytes"]) / 1e6,
    }  # fmt: skip


COLUMNS = [
    ("server", "{}"), ("turn", "{}"), ("ttft_ms", "{:.1f}"), ("text_ttft_ms", "{:.1f}"),
    ("ttft_vs_text", "{:.2f}"), ("prompt_tokens", "{:.0f}"), ("new_tokens", "{:.0f}"),
    ("text_new_tokens", "{:.0f}"), ("main_cpu_ms_per_image", "{:.2f}"),
    ("worker_cpu_ms_per_image", "{:.2f}"), ("pixel_mb_to_ranks", "{:.2f}"),
    ("text_main_cpu_ms_per_request", "{:.2f}"), ("ids_vs_text", "{:.2f}"), ("load_avg", "{:.1f}"),
]  # fmt: skip


def line(r: dict[str, Any]) -> str:
    return "  ".join(f"{name}={fmt.format(r[name])}" for name, fmt in COLUMNS)


def table(rows: list[dict[str, Any]]) -> str:
    head = " | ".join(name for name, _ in COLUMNS)
    body = [" | ".join(fmt.format(r[name]) for name, fmt in COLUMNS) for r in rows]
    return "\n".join([head, *body])


def stage_table(rows: list[dict[str, Any]]) -> str:
    """Per turn, each stage's mean ms per request: image turn / text-only turn (the server's
    stages from its route's start; the client's upload from its clock's start)."""
    names = ["upload", *STAGES]
    head = " | ".join(["server", "turn", *names])
    body = [
        " | ".join(
            [str(r["server"]), str(r["turn"])]
            + [f"{r.get(f'stage_{n}_ms', r.get(f'{n}_ms')):.1f}/"
               f"{r.get(f'text_stage_{n}_ms', r.get(f'text_{n}_ms')):.1f}" for n in names]
        )
        for r in rows
    ]  # fmt: skip
    return "\n".join([head, *body])


# ---------------------------------------------------------------- hashing


def hash_speeds(size_mb: float = 4.0, repeat: int = 20) -> dict[str, float]:
    """GB/s of SHA-256 and XXH3-128 (the item digest) over random bytes, side by side."""
    from tokenizer_manager.media.multimodal_inputs import new_digest

    data = np.random.default_rng(0).bytes(int(size_mb * 1e6))

    def speed(make: Any) -> float:
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            digest = make()
            digest.update(data)
            digest.digest()
            best = min(best, time.perf_counter() - start)
        return len(data) / best / 1e9

    sha, xxh3 = speed(hashlib.sha256), speed(new_digest)
    return {"sha256_gb_s": sha, "xxh3_128_gb_s": xxh3, "xxh3_vs_sha256": xxh3 / sha}


# ---------------------------------------------------------------- the front end alone


def frontend_costs(model_path: str, size: int, images: int = 8) -> dict[str, float]:
    """CPU ms per image of the media front end (this process plus its media workers) for new
    images (misses) and the same images resent (hits), with /dev/shm as the server uses it."""
    from runtime.multimodal import Modality
    from runtime.transport.shm import local_shm_dir
    from tokenizer_manager.media.limits import MediaLimits
    from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
    from tokenizer_manager.media.types import MediaRef

    rng = np.random.default_rng(1)
    refs = [MediaRef(Modality.IMAGE, image_url(rng, size)) for _ in range(images)]

    async def run() -> dict[str, float]:
        async with AsyncMMDataProcessor(
            model_path, MediaLimits(), shm_dir=local_shm_dir(1), cache_bytes=1 << 30
        ) as mm:
            await mm.warmup()
            out = {}
            for name in ("miss", "hit"):
                before = frontend_cpu_s(mm.worker_pids())
                for ref in refs:  # one at a time, as the turns of a conversation send them
                    await mm.process([ref])
                out[f"{name}_cpu_ms_per_image"] = (
                    (frontend_cpu_s(mm.worker_pids()) - before) * 1e3 / images
                )
            out["hit_vs_miss"] = out["hit_cpu_ms_per_image"] / out["miss_cpu_ms_per_image"]
            return out

    return asyncio.run(run())


def frontend_cpu_s(workers: list[int]) -> float:
    """CPU seconds of this process (every thread) and of the media workers."""
    return time.process_time() + sum(proc_stat(pid).cpu_s for pid in workers)


# ---------------------------------------------------------------- routing (--routing)


@dataclass(frozen=True)
class Setup:
    """One routing setup: `servers` tessera servers with `flags`, behind sglang-router with
    policy `router` when it is given (else the one server is asked directly)."""

    name: str
    flags: tuple[str, ...]
    servers: int = 1
    router: str | None = None
    pinned: bool = False  # each server on its own share of the CPUs, as --dp splits them


TP1 = ("--tp", "1")
ROUTING_SETUPS = (
    Setup("dp1", (*TP1, "--dp", "1")),
    *(Setup(p, (*TP1, "--dp", "2", "--dp-policy", p)) for p in DP_POLICIES),
    Setup("router", (*TP1, "--dp", "1"), servers=2, router="cache_aware"),
)
# run only when named: the router's two workers on one CPU share each (`taskset`), as `--dp 2`
# shares the CPUs out between its replicas; the plain `router` lets the one busy worker take all
NAMED_SETUPS = (
    Setup("router_pinned", (*TP1, "--dp", "1"), servers=2, router="cache_aware", pinned=True),
)


def routing_setups(names: str | None) -> list[Setup]:
    """The setups named (comma-separated, in the order given); all of them for None."""
    if names is None:
        return list(ROUTING_SETUPS)
    known = {s.name: s for s in (*ROUTING_SETUPS, *NAMED_SETUPS)}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        raise SystemExit(f"--routing-setups: unknown {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names.split(",")]


def replica_counts(info: dict[str, Any]) -> list[int]:
    """Requests routed to each replica, from one server's /server_info."""
    return [int(r["routed"]) for r in info.get("replicas") or []]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear between the closest ranks); NaN with no values."""
    return float(np.percentile(values, q)) if values else math.nan


def routing_row(
    name: str, convs: list[Reply], singles: list[Reply], wall_s: float, routed: list[int]
) -> dict[str, Any]:
    """One setup's numbers; `routed` is each replica's request count during the measurement."""
    both = convs + singles
    prompt = sum(r.prompt_tokens for r in both)
    conv_prompt = sum(r.prompt_tokens for r in convs)
    return {
        "setup": name, "requests": len(both),
        "cached_share": sum(r.cached_tokens for r in both) / prompt if prompt else math.nan,
        "conv_cached_share": (
            sum(r.cached_tokens for r in convs) / conv_prompt if conv_prompt else math.nan
        ),
        "conv_ttft_p50_ms": percentile([r.ttft_s * 1e3 for r in convs], 50),
        "conv_ttft_p99_ms": percentile([r.ttft_s * 1e3 for r in convs], 99),
        "single_ttft_p50_ms": percentile([r.ttft_s * 1e3 for r in singles], 50),
        "single_ttft_p99_ms": percentile([r.ttft_s * 1e3 for r in singles], 99),
        "requests_per_s": len(both) / wall_s,
        "routed": routed,
        "load_ratio": max(routed) / min(routed) if routed and min(routed) else math.inf,
    }  # fmt: skip


def against_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its cached share over `dp1`'s and its conversations' p50 over the
    router's (NaN where that setup did not run)."""
    by = {r["setup"]: r for r in rows}
    ref = by.get("dp1", {}).get("cached_share", math.nan)
    router = by.get("router", {}).get("conv_ttft_p50_ms", math.nan)
    return [
        r | {"cached_vs_dp1": r["cached_share"] / ref, "conv_p50_vs_router": (
            r["conv_ttft_p50_ms"] / router)}
        for r in rows
    ]  # fmt: skip


async def converse(api: Api, conv: Conversation, turns: int) -> list[Reply]:
    """A conversation's turns, one after another, each resending everything (images too)."""
    out = []
    for k in range(turns):
        conv.ask(k)
        out.append(await turn(api, conv))
    return out


async def single_turns(api: Api, rng: np.random.Generator, size: int, n: int) -> list[Reply]:
    """`n` unrelated one-turn image chats (new images each), one after another."""
    return [await turn(api, image_conversation(rng, size)) for _ in range(n)]


async def warm_up(url: str, model: str, replicas: int, size: int, seed: int) -> None:
    """One image chat sent to each replica of the server at `url` by `data_parallel_rank`."""
    rng = np.random.default_rng(seed)
    async with chat_session(url) as session:
        api = Api(session, model, 2)
        for rank in range(replicas):
            conv = image_conversation(rng, size)
            body = json.loads(encode(api, conv)) | {"data_parallel_rank": rank}
            await turn(api, conv, json.dumps(body).encode())


def routed_now(urls: list[str]) -> list[int]:
    """Every replica's request count, server after server."""
    out: list[int] = []
    for url in urls:
        out += replica_counts(httpx.get(url + "/server_info", timeout=60, trust_env=False).json())
    return out


async def measure(url: str, model: str, args: argparse.Namespace, seed: int) -> tuple:
    """The conversations and the single turns at once: (their replies, wall seconds)."""
    rng = np.random.default_rng(seed)
    convs = [image_conversation(rng, args.image_size) for _ in range(args.conversations)]
    async with chat_session(url) as session:
        api = Api(session, model, args.max_tokens)
        start = time.perf_counter()
        jobs = [converse(api, c, args.turns) for c in convs]
        jobs.append(single_turns(api, rng, args.image_size, args.single_turn))
        out = await asyncio.gather(*jobs)
        wall = time.perf_counter() - start
    return [r for replies in out[:-1] for r in replies], out[-1], wall


def router_server(setup: Setup, workers: list[Server], log_dir: Path) -> list[Server]:
    """sglang-router with the setup's policy in front of `workers` (not started), in a list:
    none for a setup without a router."""
    if setup.router is None:
        return []
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls"]
    argv += [w.url for w in workers] + ["--policy", setup.router, "--host", "127.0.0.1"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return [Server(setup.name, [*argv, "--log-level", "warn"], log_dir / f"{setup.name}.log")]


def wait_router(router: Server, workers: int, timeout_s: float = 120) -> None:
    """Until the router has registered `workers` healthy workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"the router exited; see {router.log}")
        try:
            listed = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
            if len(listed) == workers and all(w["is_healthy"] for w in listed):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the router did not register its workers; see {router.log}")


def setup_servers(setup: Setup, args: argparse.Namespace) -> list[Server]:
    """The setup's tessera servers (not started): named as the setup, or NAME-wI behind a
    router."""
    names = [f"{setup.name}-w{i}" for i in range(setup.servers)] if setup.router else [setup.name]
    spec = shlex.join(setup.flags)
    servers = [make_server(f"{name}={spec}", args.model_path, args.log_dir) for name in names]
    for i, server in enumerate(servers if setup.pinned else []):
        server.cpus = rank_cpus(i, len(servers))
    return servers


def start_setup(servers: list[Server], router: list[Server], timeout_s: float) -> None:
    """Start the tessera servers, then the router (if any) once they serve."""
    for server in servers:
        server.start()
    for server in servers:
        server.wait_ready(timeout_s)
    for front in router:
        front.start()
        wait_router(front, len(servers))


def run_setup(setup: Setup, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Start the setup, warm every replica, measure, stop it all; its row."""
    servers = setup_servers(setup, args)
    router = router_server(setup, servers, args.log_dir)
    try:
        start_setup(servers, router, args.ready_timeout)
        model = httpx.get(servers[0].url + "/v1/models", timeout=60).json()["data"][0]["id"]
        replicas = int(setup.flags[setup.flags.index("--dp") + 1])
        for i, server in enumerate(servers):
            asyncio.run(warm_up(server.url, model, replicas, args.image_size, 10_000 + i))
        urls = [s.url for s in servers]
        before = routed_now(urls)
        convs, singles, wall = asyncio.run(measure((router or servers)[0].url, model, args, seed))
        routed = [a - b for a, b in zip(routed_now(urls), before, strict=True)]
    finally:
        for server in [*router, *servers]:
            server.stop()  # one never started is left as it is
    row = routing_row(setup.name, convs, singles, wall, routed)
    return row | {"load_avg": os.getloadavg()[0]}


ROUTING_COLUMNS = [
    ("setup", "{}"), ("cached_share", "{:.3f}"), ("conv_cached_share", "{:.3f}"),
    ("cached_vs_dp1", "{:.2f}"), ("conv_ttft_p50_ms", "{:.0f}"), ("conv_ttft_p99_ms", "{:.0f}"),
    ("conv_p50_vs_router", "{:.2f}"), ("single_ttft_p50_ms", "{:.0f}"),
    ("single_ttft_p99_ms", "{:.0f}"), ("requests_per_s", "{:.2f}"), ("routed", "{}"),
    ("load_ratio", "{:.2f}"), ("load_avg", "{:.1f}"),
]  # fmt: skip


def routing_table(rows: list[dict[str, Any]]) -> str:
    head = " | ".join(name for name, _ in ROUTING_COLUMNS)
    body = [" | ".join(fmt.format(r[name]) for name, fmt in ROUTING_COLUMNS) for r in rows]
    return "\n".join([head, *body])


def routing_medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setup, in the order they first ran: the median of every number over the
    rounds, each replica's requests summed and their ratio taken from the sums."""
    out = []
    for name in dict.fromkeys(r["setup"] for r in rows):
        group = [r for r in rows if r["setup"] == name]
        numbers = {
            key: statistics.median(r[key] for r in group)
            for key, value in group[0].items()
            if isinstance(value, float | int) and key != "round"
        }
        routed = [sum(counts) for counts in zip(*(r["routed"] for r in group), strict=True)]
        ratio = max(routed) / min(routed) if min(routed) else math.inf
        out.append({"setup": name, **numbers, "routed": routed, "load_ratio": ratio,
                    "rounds": len(group)})  # fmt: skip
    return out


def run_routing(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every round's rows (setups in an order that rotates from round to round, new images each
    round) and the setups' medians over the rounds, with the targets."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    setups, rows = routing_setups(args.routing_setups), []
    for r in range(args.rounds):
        for setup in setups[r % len(setups) :] + setups[: r % len(setups)]:
            rows.append(run_setup(setup, args, args.seed + 1000 * r) | {"round": r})
            print(json.dumps(rows[-1]), flush=True)
    return {"rounds": rows, "routing": against_targets(routing_medians(rows))}


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--server", action="append", default=None, help="NAME=LAUNCH_ARGS")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--image-size", type=int, default=448, help="side of the square images, px")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="rounds of every configuration, rotated")
    p.add_argument("--hash-only", action="store_true", help="only the hash micro-benchmark")
    p.add_argument(
        "--frontend-only",
        action="store_true",
        help="only the media front end in this process: CPU per image on a miss and on a hit",
    )
    p.add_argument(
        "--routing", action="store_true", help="the data-parallel routing benchmark instead"
    )
    p.add_argument(
        "--routing-setups",
        default=None,
        help="--routing: comma-separated setups to run (default: "
        + ",".join(s.name for s in ROUTING_SETUPS)
        + ")",
    )
    p.add_argument(
        "--single-turn", type=int, default=12, help="--routing: one-turn image chats alongside"
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench_multiturn_logs"))
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def make_server(spec: str, model_path: str, log_dir: Path) -> Server:
    """`NAME=LAUNCH ARGS`: a tessera server named NAME started with those flags."""
    name, _, flags = spec.partition("=")
    return tessera_server(name, shlex.split(flags), model_path, log_dir)


def run_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every round's rows (each with its `round`): the servers run side by side, idle in turn."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    specs = args.server or DEFAULT_SERVERS
    servers = [make_server(spec, args.model_path, args.log_dir) for spec in specs]
    rows: list[dict[str, Any]] = []
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(args.ready_timeout)
        for r in range(args.rounds):
            for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                seed = args.seed + 1000 * r  # new images every round
                rows += [x | {"round": r} for x in asyncio.run(run_config(server, args, seed))]
    finally:
        for server in servers:
            server.stop()
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (configuration, turn): the median of every number over the rounds."""
    keys = list(dict.fromkeys((r["server"], r["turn"]) for r in rows))
    out = []
    for server, k in keys:
        group = [r for r in rows if (r["server"], r["turn"]) == (server, k)]
        numbers = {
            name: statistics.median(r[name] for r in group)
            for name, value in group[0].items()
            if isinstance(value, float | int) and name not in ("turn", "round")
        }
        out.append({"server": server, "turn": k, **numbers, "rounds": len(group)})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.routing:
        if not args.model_path:
            raise SystemExit("--routing needs --model-path")
        out = run_routing(args)
        print(routing_table(out["routing"]))
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return out
    report: dict[str, Any] = {"hash": hash_speeds()}
    print(json.dumps(report["hash"]), flush=True)
    if not args.hash_only and not args.model_path:
        raise SystemExit("--model-path is required (or --hash-only)")
    if not args.hash_only:
        report["frontend"] = frontend_costs(args.model_path, args.image_size)
        print(json.dumps(report["frontend"]), flush=True)
    if not args.hash_only and not args.frontend_only:
        report["rounds"] = run_servers(args)
        report["turns"] = medians(report["rounds"])
        print(table(report["turns"]))
        print(stage_table(report["turns"]))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
