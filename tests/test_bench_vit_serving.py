"""The serving mode of scripts/bench_vit_dp_vs_tp.py: its flags and its table (the runs
themselves start servers and are measured by hand, docs/benchmarks.md)."""

from __future__ import annotations

import bench_vit_dp_vs_tp
import bench_vit_serving
import pytest


def summary(rps: float, ttft: float, itl: float, failed: int = 0) -> dict:
    stats = {"median": ttft, "p99": ttft * 2, "mean": ttft}
    return {"request_throughput": rps, "ttft_ms": stats, "failed": failed,
            "itl_ms": {"median": itl, "p99": None, "mean": itl}}  # fmt: skip


def test_serving_flags_parse() -> None:
    args = bench_vit_dp_vs_tp.parse_args(["--serving", "--modes", "disagg,dp", "--bursts", "3"])
    assert args.serving and args.modes == "disagg,dp" and args.bursts == 3
    burst, chat = bench_vit_serving.workloads(args)
    assert burst.images_per_request == 4 and chat.images_per_request == 0
    assert chat.output_len == args.chat_tokens > burst.output_len


def test_table_rows_name_mode_stream_and_the_mixed_stream_parts() -> None:
    results = {
        "disagg/encoder-heavy": {"all": summary(1.5, 100, 20)},
        "dp/mixed": {"all": summary(2.0, 50, 30), "chats": summary(1, 10, 40, 1),
                     "bursts": summary(1, 300, 0)},  # fmt: skip
    }
    results["dp/mixed"]["chats_in_bursts"] = {"median": 50.0, "p99": 250.0, "mean": 60.0}
    header, rule, heavy, mixed = bench_vit_serving.table(results)
    assert header.count("|") == rule.count("|") == heavy.count("|") == mixed.count("|")
    assert heavy.split(" | ")[:3] == ["| disagg", "encoder-heavy", "1.50"]
    assert heavy.rstrip(" |").endswith("- | - | - | - | 0")
    cells = mixed.strip("| ").split(" | ")
    assert cells[:7] == ["dp", "mixed", "2.00", "50", "100", "30", "-"]
    assert cells[7:] == ["40", "-", "250", "300", "0"]


def test_the_encoder_pools_counts_are_read_and_printed_per_run() -> None:
    """A run with encoder servers reports their items and the spilled requests from the LLM
    server's /server_info (a listener on 127.0.0.1 this test starts); one without, nothing."""
    import http.server
    import json
    import threading

    answers = [{"media": {"encoder_servers": {"items_sent": 9, "spilled_requests": 3}}}, {}]

    class Info(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(answers.pop(0)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        pool = bench_vit_serving.encoder_pool_info(url)
        assert pool == {"items_sent": 9, "spilled_requests": 3}
        assert bench_vit_serving.encoder_pool_info(url) is None
    finally:
        server.shutdown()
    results = {"spill/mixed": {"all": summary(1, 1, 1), "encoder_pool": pool},
               "dp/mixed": {"all": summary(1, 1, 1)}}  # fmt: skip
    assert bench_vit_serving.pool_lines(results) == [
        "spill/mixed: 9 items sent to the encoder servers, 3 requests spilled to the LLM's tower"
    ]


def test_only_the_chats_gaps_inside_the_bursts_window_count() -> None:
    from bench_serving import RequestRecord

    chat = RequestRecord(True, 10.0, ttft=0.5, itl=(1.0, 3.0, 0.5, 2.0))  # sent at 0.5 s: its
    out = bench_vit_serving.gaps_in_window([(0.5, chat)], (4.0, 6.0))  # gaps end 2, 5, 5.5, 7.5
    assert out["median"] == pytest.approx(1750.0) and out["p99"] == pytest.approx(2975.0)
    assert bench_vit_serving.gaps_in_window([(0.5, chat)], (8.0, 9.0))["p99"] is None


def test_plot_draws_every_mode_of_both_streams(tmp_path) -> None:  # noqa: ANN001
    results = {
        "disagg/encoder-heavy": {"all": summary(1.5, 100, 20)},
        "dp/encoder-heavy": {"all": summary(1.4, 120, 25)},
        "disagg/mixed": {"all": summary(2.0, 50, 30), "chats": summary(1, 10, 40),
                         "bursts": summary(1, 300, 0),
                         "chats_in_bursts": {"median": 50.0, "p99": 250.0}},  # fmt: skip
    }
    path = tmp_path / "serving.png"
    bench_vit_serving.plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_loops_send_one_chat_after_another_until_told_to_stop() -> None:
    """Against a fake chat endpoint (three content chunks 20 ms apart): each client's chats
    follow one another, and no chat is sent once `done` is set."""
    import asyncio
    import json
    import time

    from aiohttp import web
    from bench_serving import Workload

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("a", "b", "c"):
            await asyncio.sleep(0.02)
            chunk = {"choices": [{"delta": {"content": word}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def run() -> tuple[list, float]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        done, start = asyncio.Event(), time.perf_counter()
        asyncio.get_running_loop().call_later(0.3, done.set)
        chat = Workload(0, ((56, 56),), "png", 4, 3, seed=0)
        try:
            out = await bench_vit_serving.chat_loops(f"http://127.0.0.1:{port}", "m", chat, 2, done)
        finally:
            await runner.cleanup()
        return out, time.perf_counter() - start

    sent, took = asyncio.run(run())
    assert all(r.ok and r.output_tokens == 3 and len(r.itl) == 2 for _, r in sent)
    assert 2 <= len(sent) <= 12 and all(at < 0.3 for at, _ in sent)  # 60+ ms a chat, 2 clients
    assert took < 5.0  # the chats sent before `done` end, and no other
    in_window = bench_vit_serving.gaps_in_window(sent, (0.0, 0.3))
    assert 15 < in_window["median"] < 200
