"""Load generator for an OpenAI-compatible chat server: tessera's, or SGLang / vLLM to compare.

    python scripts/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \\
        --images-per-request 1 --image-sizes 448x448,224x336 --input-len 64 --output-len 128 \\
        --request-rate 8 --max-concurrency 32 --warmup 4 --label tessera --output-json run.json

Every request carries --images-per-request synthetic images (seeded noise, sent inline as base64
PNG or JPEG data URLs) and a text of --input-len words drawn from a fixed word list. It asks for
--output-len tokens at temperature 0 and sends "ignore_eos": true (turn off with --no-ignore-eos
for servers that reject unknown fields), so every server generates the same amount of text.
Answers stream over SSE with a final usage chunk. Requests arrive as a Poisson process at
--request-rate per second (inf: all at once), at most --max-concurrency in flight. --warmup
requests (different images and text, so they warm no cache the measured ones use) go first and
are left out of the numbers.

Per request: TTFT (time to the first content chunk), ITL (gaps between content chunks), TPOT
((e2e - ttft) / (output tokens - 1)) and end-to-end latency. Output tokens come from the usage
chunk when the server sends one, else one token per content chunk. The report gives request,
output-token and total-token throughput, mean / median / p99 of each latency in ms, and the
success and failure counts with the first few error messages.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from PIL import Image

ImageSize = tuple[int, int]  # (width, height)

MEASURED_STREAM = 0  # RNG stream ids: measured requests, warmup requests, arrival times
WARMUP_STREAM = 1
ARRIVAL_STREAM = 2
MAX_ERRORS_KEPT = 5
JPEG_QUALITY = 90

WORDS = (
    "the", "image", "shows", "a", "small", "red", "house", "near", "river", "under", "bright",
    "blue", "sky", "with", "two", "trees", "and", "an", "old", "stone", "bridge", "where",
    "people", "walk", "their", "dogs", "in", "morning", "light", "while", "birds", "fly",
    "over", "green", "hills", "far", "away", "from", "busy", "city", "streets", "full", "of",
    "cars", "shops", "signs", "windows", "doors", "roofs", "clouds", "shadows", "colors",
    "describe", "every", "detail", "count", "objects", "read", "text", "explain", "scene",
    "left", "right", "top",
)  # fmt: skip


# ---------------------------------------------------------------- request generation (pure)


@dataclass(frozen=True)
class Workload:
    """What every synthetic request looks like; the seed makes the whole set reproducible."""

    images_per_request: int
    image_sizes: tuple[ImageSize, ...]
    image_format: str  # "png" or "jpeg"
    input_len: int  # words of text
    output_len: int  # max_tokens
    seed: int


@dataclass(frozen=True)
class BenchRequest:
    index: int
    text: str
    image_urls: tuple[str, ...]
    image_sizes: tuple[ImageSize, ...]
    output_len: int


def parse_image_sizes(spec: str) -> tuple[ImageSize, ...]:
    """'448x448,224x336' -> ((448, 448), (224, 336)); width first."""
    sizes = []
    for item in spec.split(","):
        width, sep, height = item.strip().lower().partition("x")
        if not (sep and width.isdigit() and height.isdigit() and int(width) and int(height)):
            raise ValueError(f"bad image size {item!r}: expected WIDTHxHEIGHT, e.g. 448x448")
        sizes.append((int(width), int(height)))
    return tuple(sizes)


def make_image(rng: np.random.Generator, size: ImageSize) -> Image.Image:
    width, height = size
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_data_url(image: Image.Image, image_format: str) -> str:
    buffer = io.BytesIO()
    if image_format == "jpeg":
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buffer, format="PNG")
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"data:image/{image_format};base64,{encoded}"


def make_text(rng: np.random.Generator, num_words: int) -> str:
    picks = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in picks)


def make_request(workload: Workload, stream: int, index: int) -> BenchRequest:
    """Request `index` of RNG stream `stream`; depends only on (seed, stream, index)."""
    rng = np.random.default_rng([workload.seed, stream, index])
    picks = rng.integers(0, len(workload.image_sizes), size=workload.images_per_request)
    sizes = tuple(workload.image_sizes[i] for i in picks)
    urls = tuple(image_data_url(make_image(rng, size), workload.image_format) for size in sizes)
    text = make_text(rng, workload.input_len)
    return BenchRequest(index, text, urls, sizes, workload.output_len)


def generate_requests(
    workload: Workload, count: int, stream: int = MEASURED_STREAM
) -> list[BenchRequest]:
    return [make_request(workload, stream, index) for index in range(count)]


def build_payload(request: BenchRequest, model: str, ignore_eos: bool) -> dict[str, Any]:
    """The chat-completions body: images first, then the text, streamed with a usage chunk."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": url}} for url in request.image_urls
    ]
    content.append({"type": "text", "text": request.text})
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: a Poisson process at `rate`/s, first at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[:1] = 0.0
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------- one streamed response


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error body ({"error": {...}} or {"object": "error"})."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    if body.get("object") == "error":
        return str(body.get("message") or body)
    return None


def has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


@dataclass
class StreamTrace:
    """What one streamed answer showed: arrival time of each content chunk, usage, error."""

    chunk_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str | None = None

    def feed(self, line: str, now: float) -> None:
        """Take one SSE line; only `data:` lines matter, `[DONE]` ends the stream."""
        if not line.startswith("data:") or self.error is not None:
            return
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"unreadable SSE data: {data[:200]}"
            return
        self.error = error_message(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if has_content(chunk):
            self.chunk_times.append(now)


@dataclass(frozen=True)
class RequestRecord:
    """The outcome of one request; times in seconds, measured from when it was sent."""

    ok: bool
    latency: float
    ttft: float = 0.0
    itl: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def finish_trace(trace: StreamTrace, start: float, end: float) -> RequestRecord:
    if trace.error is not None:
        return RequestRecord(ok=False, latency=end - start, error=trace.error)
    usage = trace.usage or {}
    times = trace.chunk_times
    if not times and usage.get("completion_tokens"):
        times = [end]  # tokens that show no text yet (a held-back partial UTF-8 char)
    if not times:
        return RequestRecord(ok=False, latency=end - start, error="stream ended without content")
    return RequestRecord(
        ok=True,
        latency=end - start,
        ttft=times[0] - start,
        itl=tuple(later - earlier for earlier, later in zip(times, times[1:])),
        output_tokens=int(usage.get("completion_tokens") or len(times)),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
    )


# ---------------------------------------------------------------- metric aggregation (pure)


def describe_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p99 (linear interpolation) in ms; None when there is nothing to count."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p99": float(np.percentile(values, 99)),
    }


def per_second(amount: float, duration_s: float) -> float:
    return amount / duration_s if duration_s > 0 else 0.0


def first_errors(records: Sequence[RequestRecord], limit: int = MAX_ERRORS_KEPT) -> list[str]:
    return [r.error for r in records if not r.ok][:limit]


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Throughput counts successful requests only; latencies come from successful ones too."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok), duration_s),
        "output_throughput": per_second(output_tokens, duration_s),
        "total_token_throughput": per_second(input_tokens + output_tokens, duration_s),
        "ttft_ms": describe_ms([r.ttft for r in ok]),
        "itl_ms": describe_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": describe_ms(tpots),
        "e2e_ms": describe_ms([r.latency for r in ok]),
        "errors": first_errors(records),
    }


# ---------------------------------------------------------------- async runner


class BenchError(RuntimeError):
    """The benchmark cannot start (server unreachable, no model listed)."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model_id(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
            body = json.loads(await resp.read())
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise BenchError(f"cannot list models at {base_url}/v1/models: {reason}") from exc
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def http_error(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.read()).decode("utf-8", errors="replace")
    try:
        message = error_message(json.loads(text))
    except json.JSONDecodeError:
        message = None
    return f"HTTP {resp.status}: {message or text[:300]}"


async def read_stream(resp: aiohttp.ClientResponse, trace: StreamTrace) -> None:
    """Split the body into lines as bytes arrive; each line is stamped with its arrival time."""
    pending = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            trace.feed(line.decode("utf-8").strip(), now)
    if pending.strip():
        trace.feed(pending.decode("utf-8").strip(), time.perf_counter())


async def send_request(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> RequestRecord:
    headers = {**headers, "Content-Type": "application/json"}
    trace = StreamTrace()
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                trace.error = await http_error(resp)
            else:
                await read_stream(resp, trace)
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    return finish_trace(trace, start, time.perf_counter())


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    payloads: Sequence[dict[str, Any]],
    headers: dict[str, str],
    offsets: Sequence[float],
    max_concurrency: int | None,
) -> tuple[list[RequestRecord], float]:
    """Send each payload at its offset (waiting for a free slot if capped); records + duration.

    The bodies are serialized before the run starts: the client's CPU inside the window is
    taken from the server under test (a 0.8 MB body costs 1.4 ms to serialize)."""
    bodies = [json.dumps(payload).encode() for payload in payloads]
    slots = asyncio.Semaphore(max_concurrency or len(bodies) or 1)
    start = time.perf_counter()

    async def one(body: bytes, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with slots:
            return await send_request(session, url, body, headers)

    records = await asyncio.gather(*(one(b, o) for b, o in zip(bodies, offsets)))
    return list(records), time.perf_counter() - start


def workload_from_args(args: argparse.Namespace) -> Workload:
    sizes = args.image_sizes or ((args.image_width, args.image_height),)
    return Workload(
        images_per_request=args.images_per_request,
        image_sizes=tuple(sizes),
        image_format=args.image_format,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
    )


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    workload = workload_from_args(args)
    warmup = generate_requests(workload, args.warmup, WARMUP_STREAM)
    measured = generate_requests(workload, args.num_prompts, MEASURED_STREAM)
    offsets = arrival_offsets(len(measured), args.request_rate, args.seed)
    headers = auth_headers(args.api_key)
    url = f"{args.base_url}/v1/chat/completions"
    # --request-timeout bounds connecting and each wait for bytes, not a whole stream
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=args.request_timeout, sock_read=args.request_timeout
    )
    # the semaphore, not the client's pool, caps load; the environment's proxies are not used
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, trust_env=False
    ) as session:
        model = args.model or await first_model_id(session, args.base_url, headers)
        warm_payloads = [build_payload(r, model, args.ignore_eos) for r in warmup]
        warm, _ = await run_requests(
            session, url, warm_payloads, headers, [0.0] * len(warmup), args.max_concurrency
        )
        payloads = [build_payload(r, model, args.ignore_eos) for r in measured]
        before = await scrape(session, args.base_url, headers)
        records, duration = await run_requests(
            session, url, payloads, headers, offsets, args.max_concurrency
        )
        after = await scrape(session, args.base_url, headers)
    report = build_report(args, model, warm, summarize(records, duration))
    report["server"] = server_breakdown(before, after)
    return report


# ---------------------------------------------------------------- the server's own view

SERVER_HISTOGRAMS = {
    "ttft": "tessera_time_to_first_token_seconds",
    "itl": "tessera_inter_token_latency_seconds",
    "e2e": "tessera_e2e_request_latency_seconds",
}


async def scrape(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> dict[str, float]:
    """The server's Prometheus samples ({} when it has no /metrics): name[label...] -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(f"{base_url}/metrics", headers=headers) as resp:
            if resp.status != 200:
                return {}
            text = (await resp.read()).decode("utf-8")
        families = list(text_string_to_metric_families(text))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}
    return {
        s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
        for family in families
        for s in family.samples
    }


def server_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request (per token for ITL) of each server-side latency and stage
    during the measured run: the histograms' sum and count differences."""
    names = dict(SERVER_HISTOGRAMS)
    for key in after:
        if key.startswith("tessera_request_stage_seconds_count["):
            stage = key[len("tessera_request_stage_seconds_count[") : -1]
            names[f"stage {stage}"] = ("tessera_request_stage_seconds", f"[{stage}]")
    out = {}
    for label, metric in names.items():
        base, labels = metric if isinstance(metric, tuple) else (metric, "")
        count = after.get(f"{base}_count{labels}", 0) - before.get(f"{base}_count{labels}", 0)
        total = after.get(f"{base}_sum{labels}", 0) - before.get(f"{base}_sum{labels}", 0)
        if count > 0:
            out[label] = total / count * 1000
    return out


# ---------------------------------------------------------------- report


def json_safe_args(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as plain JSON: inf as the string "inf", paths as text, the API key hidden."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        elif key == "api_key" and value:
            value = "***"
        elif key == "image_sizes" and value:
            value = [f"{w}x{h}" for w, h in value]
        elif isinstance(value, Path):
            value = str(value)
        out[key] = value
    return out


def build_report(
    args: argparse.Namespace,
    model: str,
    warmup: Sequence[RequestRecord],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    return {
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": json_safe_args(args),
        "warmup": {"sent": len(warmup), "failed": sum(not r.ok for r in warmup)},
        "metrics": metrics,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_lines(report: dict[str, Any]) -> list[str]:
    m = report["metrics"]
    title = f" bench_serving: {report['label']} " if report["label"] else " bench_serving "
    rows = [
        ("Model", report["model"]),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Duration (s)", fmt(m["duration_s"])),
        ("Input tokens", m["total_input_tokens"]),
        ("Output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", fmt(m["request_throughput"])),
        ("Output token throughput (tok/s)", fmt(m["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(m["total_token_throughput"])),
    ]
    lines = [title.center(60, "="), *(f"{name:<34}{value:>26}" for name, value in rows)]
    lines.append(f"{'Latency (ms)':<24}{'mean':>12}{'median':>12}{'p99':>12}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        stats = m[f"{name}_ms"]
        cells = "".join(f"{fmt(stats[k]):>12}" for k in ("mean", "median", "p99"))
        lines.append(f"{name.upper():<24}{cells}")
    server = report.get("server") or {}
    if server:
        lines.append(f"{'Server side, mean (ms)':<34}")
        lines.extend(f"  {name:<32}{fmt(value):>26}" for name, value in server.items())
    lines.extend(f"error: {message}" for message in m["errors"])
    return [*lines, "=" * 60]


# ---------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def positive_rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (or inf), got {text}")
    return value


def image_sizes_arg(text: str) -> tuple[ImageSize, ...]:
    try:
        return parse_image_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=positive_int, default=100)
    p.add_argument("--images-per-request", type=non_negative_int, default=1)
    p.add_argument("--image-width", type=positive_int, default=448)
    p.add_argument("--image-height", type=positive_int, default=448)
    p.add_argument(
        "--image-sizes",
        type=image_sizes_arg,
        default=None,
        help="WxH list sampled per image, e.g. 448x448,224x336 (overrides width/height)",
    )
    p.add_argument("--image-format", choices=("png", "jpeg"), default="png")
    p.add_argument("--input-len", type=non_negative_int, default=64, help="words of text")
    p.add_argument("--output-len", type=positive_int, default=128, help="max_tokens")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='send "ignore_eos": true so every answer is --output-len tokens long',
    )
    p.add_argument(
        "--request-rate",
        type=positive_rate,
        default=math.inf,
        help="Poisson arrivals per second; inf sends everything at once",
    )
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait on the server at any one point (connect, each read)",
    )
    p.add_argument("--label", default="", help="a tag stored in the report")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON; 0 when any request succeeded."""
    args = parse_args(argv)
    try:
        report = asyncio.run(benchmark(args))
    except BenchError as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report_lines(report)))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["metrics"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
