"""scripts/bench_serving.py: metric aggregation, request generation, a run against a fake server.

The fake server is a small FastAPI app on 127.0.0.1 (uvicorn in a background thread): it lists one
model, streams a few content chunks with short sleeps and a usage chunk, and answers 400 with an
OpenAI-style error body for any request whose text it was told to reject.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_serving as bench  # scripts/ is on sys.path (conftest)
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from waits import wait_until

MODEL_ID = "fake-vlm"
CHUNK_SLEEP_S = 0.02
TOKENS_PER_IMAGE = 10


# ---------------------------------------------------------------- metric aggregation


def hand_made_records() -> list[Any]:
    record = bench.RequestRecord
    return [
        record(ok=True, latency=1.0, ttft=0.2, itl=(0.1, 0.3), output_tokens=5, prompt_tokens=10),
        record(ok=True, latency=2.0, ttft=0.4, itl=(0.2,), output_tokens=3, prompt_tokens=20),
        record(ok=True, latency=0.5, ttft=0.5, itl=(), output_tokens=1, prompt_tokens=5),
        record(ok=False, latency=0.1, error="HTTP 400: bad image"),
    ]


def test_tpot_needs_two_tokens_and_success() -> None:
    records = hand_made_records()
    assert records[0].tpot == pytest.approx((1.0 - 0.2) / 4)
    assert records[1].tpot == pytest.approx((2.0 - 0.4) / 2)
    assert records[2].tpot is None
    assert records[3].tpot is None


def test_describe_ms_mean_median_p99() -> None:
    stats = bench.describe_ms([0.5, 0.2, 0.4])
    assert stats["mean"] == pytest.approx(1100 / 3)
    assert stats["median"] == pytest.approx(400.0)
    assert stats["p99"] == pytest.approx(400 + 0.98 * 100)  # linear between 400 and 500
    assert bench.describe_ms([]) == {"mean": None, "median": None, "p99": None}


def test_summarize_counts_throughput_and_latencies() -> None:
    m = bench.summarize(hand_made_records(), duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 9)
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(9 / 4)
    assert m["total_token_throughput"] == pytest.approx(44 / 4)
    assert m["ttft_ms"]["median"] == pytest.approx(400.0)
    assert m["itl_ms"] == pytest.approx({"mean": 200.0, "median": 200.0, "p99": 298.0})
    assert m["tpot_ms"] == pytest.approx({"mean": 500.0, "median": 500.0, "p99": 794.0})
    assert m["e2e_ms"] == pytest.approx({"mean": 3500 / 3, "median": 1000.0, "p99": 1980.0})
    assert m["errors"] == ["HTTP 400: bad image"]


def test_summarize_empty_and_error_cap() -> None:
    empty = bench.summarize([], duration_s=0.0)
    assert (empty["completed"], empty["failed"], empty["request_throughput"]) == (0, 0, 0.0)
    assert empty["ttft_ms"]["p99"] is None
    failures = [bench.RequestRecord(ok=False, latency=0.0, error=f"e{i}") for i in range(9)]
    assert bench.summarize(failures, 1.0)["errors"] == ["e0", "e1", "e2", "e3", "e4"]


# ---------------------------------------------------------------- one streamed answer


def sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}"


def content_chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_stream_trace_times_and_usage() -> None:
    trace = bench.StreamTrace()
    trace.feed(": keep-alive", 1.1)
    trace.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 1.2)
    for now in (1.5, 1.7, 2.0):
        trace.feed(sse(content_chunk("hi")), now)
    usage_line = sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}})
    trace.feed(usage_line, 2.05)
    trace.feed("data: [DONE]", 2.06)
    record = bench.finish_trace(trace, start=1.0, end=2.1)
    assert record.ok and record.ttft == pytest.approx(0.5)
    assert record.itl == pytest.approx((0.2, 0.3))
    assert (record.output_tokens, record.prompt_tokens) == (7, 11)
    assert record.latency == pytest.approx(1.1)


def test_stream_trace_without_usage_counts_chunks() -> None:
    trace = bench.StreamTrace()
    for now in (0.1, 0.2, 0.3, 0.4):
        trace.feed(sse(content_chunk("x")), now)
    assert bench.finish_trace(trace, start=0.0, end=0.5).output_tokens == 4



def test_stream_trace_tokens_without_text_succeed_at_the_end() -> None:
    """A server may generate tokens that show no text yet (vLLM holds back an incomplete UTF-8
    character, e.g. with max_tokens 1): the usage chunk proves them, the first token is the end."""
    trace = bench.StreamTrace()
    trace.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 0.1)
    trace.feed(sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}), 0.4)
    record = bench.finish_trace(trace, start=0.0, end=0.5)
    assert record.ok and record.ttft == pytest.approx(0.5) and record.itl == ()
    assert (record.output_tokens, record.prompt_tokens) == (1, 9)
    empty = bench.StreamTrace()
    empty.feed(sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 0}}), 0.4)
    assert not bench.finish_trace(empty, start=0.0, end=0.5).ok

def test_stream_trace_errors() -> None:
    trace = bench.StreamTrace()
    trace.feed(sse(content_chunk("x")), 0.1)
    trace.feed(sse({"error": {"message": "out of memory", "code": 500}}), 0.2)
    record = bench.finish_trace(trace, start=0.0, end=0.3)
    assert not record.ok and record.error == "out of memory"
    assert bench.finish_trace(bench.StreamTrace(), 0.0, 0.1).error.startswith("stream ended")
    assert bench.error_message({"object": "error", "message": "bad"}) == "bad"
    assert bench.error_message({"id": "x", "choices": []}) is None


# ---------------------------------------------------------------- request generation


def decode_data_url(url: str) -> Image.Image:
    header, encoded = url.split(",", 1)
    assert header.startswith("data:image/") and header.endswith(";base64")
    return Image.open(io.BytesIO(base64.b64decode(encoded)))


def workload(**overrides: Any) -> Any:
    fields = dict(
        images_per_request=2,
        image_sizes=((64, 48), (32, 40)),
        image_format="png",
        input_len=12,
        output_len=5,
        seed=3,
    )
    return bench.Workload(**{**fields, **overrides})


def test_generator_is_deterministic_for_a_seed() -> None:
    first = bench.generate_requests(workload(), 4)
    assert first == bench.generate_requests(workload(), 4)
    assert first != bench.generate_requests(workload(seed=4), 4)
    warmup = bench.generate_requests(workload(), 4, bench.WARMUP_STREAM)
    assert {r.text for r in warmup}.isdisjoint(r.text for r in first)


def test_generator_makes_requested_images_and_text() -> None:
    requests = bench.generate_requests(workload(), 4)
    for request in requests:
        assert len(request.image_urls) == 2 and request.output_len == 5
        images = [decode_data_url(url) for url in request.image_urls]
        assert [im.size for im in images] == list(request.image_sizes)
        assert all(im.format == "PNG" and im.mode == "RGB" for im in images)
        words = request.text.split(" ")
        assert len(words) == 12 and set(words) <= set(bench.WORDS)
    assert {size for r in requests for size in r.image_sizes} == {(64, 48), (32, 40)}


def test_generator_jpeg_and_text_only() -> None:
    (request,) = bench.generate_requests(workload(image_format="jpeg", images_per_request=1), 1)
    assert request.image_urls[0].startswith("data:image/jpeg;base64,")
    assert decode_data_url(request.image_urls[0]).format == "JPEG"
    (text_only,) = bench.generate_requests(workload(images_per_request=0), 1)
    assert text_only.image_urls == () and text_only.image_sizes == ()


def test_parse_image_sizes() -> None:
    assert bench.parse_image_sizes("448x448, 224X336") == ((448, 448), (224, 336))
    for bad in ("448", "0x10", "axb", "448x"):
        with pytest.raises(ValueError):
            bench.parse_image_sizes(bad)


def test_build_payload() -> None:
    (request,) = bench.generate_requests(workload(), 1)
    body = bench.build_payload(request, "m", ignore_eos=True)
    content = body["messages"][0]["content"]
    assert [part["type"] for part in content] == ["image_url", "image_url", "text"]
    assert content[-1]["text"] == request.text
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (5, 0.0, True)
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert "ignore_eos" not in bench.build_payload(request, "m", ignore_eos=False)


def test_arrival_offsets() -> None:
    assert bench.arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    offsets = bench.arrival_offsets(2000, 10.0, 0)
    assert offsets == bench.arrival_offsets(2000, 10.0, 0)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / 1999 == pytest.approx(0.1, rel=0.1)


# ---------------------------------------------------------------- fake OpenAI-compatible server


@dataclass
class FakeServer:
    url: str
    thread: threading.Thread
    reject_texts: set[str] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)


async def stream_answer(body: dict[str, Any], prompt_tokens: int) -> AsyncIterator[str]:
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": MODEL_ID}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    yield f"data: {json.dumps({**base, 'choices': [role]})}\n\n"
    for i in range(body["max_tokens"]):
        await asyncio.sleep(CHUNK_SLEEP_S)
        yield f"data: {json.dumps({**base, **content_chunk(f'w{i} ')})}\n\n"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def fake_app(server: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Histograms as a tessera server reports them: 50 ms TTFT and 10 ms of media each."""
        n = len(server.bodies)
        lines = [
            "# TYPE tessera_time_to_first_token_seconds histogram",
            f"tessera_time_to_first_token_seconds_count {n}",
            f"tessera_time_to_first_token_seconds_sum {0.05 * n}",
            "# TYPE tessera_request_stage_seconds histogram",
            f'tessera_request_stage_seconds_count{{stage="media"}} {n}',
            f'tessera_request_stage_seconds_sum{{stage="media"}} {0.01 * n}',
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        server.bodies.append(body)
        server.auth.append(request.headers.get("authorization"))
        content = body["messages"][0]["content"]
        if content[-1]["text"] in server.reject_texts:
            error = {"message": "marked request", "type": "BadRequestError", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        prompt_tokens = len(content[-1]["text"].split()) + TOKENS_PER_IMAGE * (len(content) - 1)
        return StreamingResponse(stream_answer(body, prompt_tokens), media_type="text/event-stream")

    return app


def free_socket() -> socket.socket:
    """A socket bound to a free 127.0.0.1 port. The TCP protocol number matters: asyncio turns
    Nagle off (TCP_NODELAY) only on accepted sockets whose proto is IPPROTO_TCP, and without that
    the chunks of a reused keep-alive connection arrive together at the end (ITL of zero)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_fake_server() -> Iterator[FakeServer]:
    """Serve the fake app on a free 127.0.0.1 port in a thread; stop and join it on exit."""
    sock = free_socket()
    server = FakeServer(url=f"http://127.0.0.1:{sock.getsockname()[1]}", thread=threading.Thread())
    config = uvicorn.Config(fake_app(server), log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    server.thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    server.thread.start()
    wait_until(lambda: uv.started or not server.thread.is_alive())
    try:
        assert uv.started, "fake server did not start"
        yield server
    finally:
        uv.should_exit = True
        server.thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with running_fake_server() as server:
        yield server
    assert not server.thread.is_alive(), "fake server thread still running"


def run_main(tmp_path: Path, url: str, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    code = bench.main(["--base-url", url, "--output-json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_end_to_end_against_fake_server(fake_server: FakeServer, tmp_path: Path) -> None:
    wl = workload(images_per_request=1, image_sizes=((32, 24),), input_len=8, output_len=4, seed=7)
    marked = bench.generate_requests(wl, 6)[2]
    fake_server.reject_texts = {marked.text}
    fake_server.bodies.clear()
    args = ["--num-prompts", "6", "--warmup", "2", "--images-per-request", "1"]
    args += ["--image-sizes", "32x24", "--input-len", "8", "--output-len", "4", "--seed", "7"]
    code, report = run_main(tmp_path, fake_server.url, *args, "--max-concurrency", "3")
    m = report["metrics"]
    assert code == 0 and report["model"] == MODEL_ID
    assert report["warmup"] == {"sent": 2, "failed": 0}
    assert (m["completed"], m["failed"]) == (5, 1)
    assert m["errors"] == ["HTTP 400: marked request"]
    assert m["total_output_tokens"] == 5 * 4
    assert m["total_input_tokens"] == 5 * (8 + TOKENS_PER_IMAGE)
    assert m["ttft_ms"]["mean"] > 0 and m["itl_ms"]["mean"] > 0 and m["tpot_ms"]["mean"] > 0
    # chunks really came one by one: chunks held back and sent together would make every gap
    # near zero, while a loaded client can only shorten some gaps by lengthening others
    assert m["itl_ms"]["p99"] >= 0.5 * CHUNK_SLEEP_S * 1000
    assert m["e2e_ms"]["median"] >= m["ttft_ms"]["median"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert report["args"]["request_rate"] == "inf" and report["args"]["max_concurrency"] == 3
    server = report["server"]  # the measured six requests only, not the warm-up
    assert server["ttft"] == pytest.approx(50) and server["stage media"] == pytest.approx(10)
    assert "Server side, mean (ms)" in "\n".join(bench.report_lines(report))
    assert len(fake_server.bodies) == 8
    for body in fake_server.bodies:
        assert body["model"] == MODEL_ID and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_end_to_end_rate_label_and_key(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.reject_texts = set()
    fake_server.bodies.clear()
    fake_server.auth.clear()
    args = ["--num-prompts", "3", "--warmup", "0", "--request-rate", "100", "--output-len", "2"]
    args += ["--model", "chosen", "--api-key", "k", "--no-ignore-eos", "--label", "ci"]
    code, report = run_main(tmp_path, fake_server.url, *args, "--image-width", "16")
    assert code == 0 and report["label"] == "ci" and report["model"] == "chosen"
    assert (report["metrics"]["completed"], report["metrics"]["failed"]) == (3, 0)
    assert report["args"]["api_key"] == "***" and report["args"]["request_rate"] == 100.0
    assert fake_server.auth == ["Bearer k"] * 3
    assert all("ignore_eos" not in body for body in fake_server.bodies)


def test_server_breakdown_without_metrics() -> None:
    assert bench.server_breakdown({}, {}) == {}
    before = {"tessera_e2e_request_latency_seconds_count": 2.0}
    before["tessera_e2e_request_latency_seconds_sum"] = 1.0
    after = {"tessera_e2e_request_latency_seconds_count": 4.0}
    after["tessera_e2e_request_latency_seconds_sum"] = 3.0
    assert bench.server_breakdown(before, after) == {"e2e": pytest.approx(1000.0)}


def test_unreachable_server(tmp_path: Path) -> None:
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
    try:
        assert bench.main(["--base-url", url, "--num-prompts", "1"]) == 2  # cannot list models
        args = ["--model", "m", "--num-prompts", "2", "--warmup", "0", "--image-width", "8"]
        code, report = run_main(tmp_path, url, *args)
    finally:
        sock.close()
    assert code == 1 and report["metrics"]["failed"] == 2
    assert report["metrics"]["errors"][0].startswith("ClientConnectorError")
