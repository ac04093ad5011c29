"""The serving side of scripts/bench_vit_dp_vs_tp.py (`--serving`): the vision tower placed
three ways at equal resources, served and loaded through the HTTP API.

    python scripts/bench_vit_dp_vs_tp.py --serving --modes disagg,dp,tp --json serve.json

Modes: `disagg`, an encoder server (`--encoder-only`, one rank, pinned to the first half of the
CPUs) plus an LLM server (`--tp 1 --encoder-urls`) whose rank is pinned to the second half (it
starts there, so its torch threads are that half's); the LLM server's other processes (HTTP
front end, media workers, detokenizer) are then let run on every CPU, as they do in the other
modes; `dp`, one server at `--tp 2` with the DP encoder; `tp`, `--tp 2` with the TP encoder;
`tp1` (not run unless named), one `--tp 1` server on every CPU: on a CPU a small decoder's
step at tp 2 is mostly its all-reduces, so tp1 tells how much of disagg's lower ITL comes from
its decoder running at tp 1 rather than from the bursts no longer stalling it; `spill` (not run
unless named), disagg with `--encoder-fallback spill`: the LLM rank keeps its tower and takes a
request's media itself while the encoder server is busy and no chat decodes there.
Two streams, each measured
on a fresh set of servers: `encoder-heavy` (requests of --burst-images images each, all at
once, at most --concurrency in flight) and `mixed` (--chats text chats decoding long answers
while bursts of image requests arrive from --burst-at seconds on). Requests come from
bench_serving's generator (seeded; ignore_eos, so every mode generates the same tokens). The
table gives requests/s, TTFT and ITL p50 / p99 per mode and stream, for the mixed stream the
chats' ITL (the decode that image bursts stall) and the bursts' TTFT apart. In the mixed stream
--chats clients each send text chats of --chat-tokens one after another from t = 0 until the
last burst is answered, so chats decode through the whole bursts' window in every mode; the
chats' ITL p99 "in bursts" counts only the gaps that end between the first burst's send and the
last burst's answer (quiet decode before and after would dilute the stalls below the 1% a p99
sees). The mixed stream's req/s counts those chats too, so it follows the decode's speed:
compare throughput on the encoder-heavy stream. `--plot` draws both streams per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import bench_serving
import httpx
from bench_serving import Workload
from stress import free_port, group_pids

ROOT = Path(__file__).resolve().parents[1]
MODES = ("disagg", "dp", "tp")  # and "tp1" and "spill", when named
STREAMS = ("encoder-heavy", "mixed")


def pinned(cpus: list[int]):
    return lambda: os.sched_setaffinity(0, cpus)


def start(cmd: list[str], log: Path, cpus: list[int] | None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        cwd=ROOT, preexec_fn=pinned(cpus) if cpus else None,
    )  # fmt: skip


def wait_for(proc: subprocess.Popen, log: Path, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 600
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def float_front_end(proc: subprocess.Popen, log: Path, cpus: list[int]) -> None:
    """Let every process of the LLM server `proc` but its scheduler rank run on `cpus` (each
    thread's affinity: a process's mask is per thread)."""
    match = re.search(r"started scheduler-TP0 \(pid (\d+)\)", log.read_text())
    if match is None:
        raise RuntimeError(f"no scheduler pid in {log}")
    for pid in group_pids(proc.pid):
        if pid == int(match.group(1)):
            continue
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, PermissionError):
                pass  # a thread or process that ended meanwhile


def launch(mode: str, model: str, workdir: Path) -> tuple[str, list[subprocess.Popen]]:
    """The mode's servers, ready; returns the LLM server's URL and the processes."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    base = [sys.executable, str(ROOT / "launch.py"), "--model-path", model, "--device", "cpu"]
    port = free_port()
    llm = [*base, "--port", str(port), "--max-total-tokens", "16000"]
    procs: list[subprocess.Popen] = []
    if mode in ("disagg", "spill"):
        enc_port = free_port()
        enc = start([*base, "--encoder-only", "--port", str(enc_port)],
                    workdir / "encoder.log", cpus[:half])  # fmt: skip
        procs.append(enc)
        log = workdir / "encoder.log"
        wait_for(enc, log, lambda: "encoder server ready" in log.read_text())
        flags = ["--tp", "1", "--encoder-urls", f"tcp://127.0.0.1:{enc_port}"]
        flags += ["--encoder-fallback", "spill"] if mode == "spill" else []
        procs.append(start([*llm, *flags], workdir / "llm.log", cpus[half:] or cpus))
    elif mode == "tp1":  # one rank, tower and decoder, on every CPU: no all-reduce at all
        procs.append(start([*llm, "--tp", "1"], workdir / "llm.log", None))
    else:
        encoder = ["--mm-enable-dp-encoder"] if mode == "dp" else ["--mm-encoder-mode", "tp"]
        procs.append(start([*llm, "--tp", "2", *encoder], workdir / "llm.log", None))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(procs[-1], workdir / "llm.log", lambda: healthy(url))
        if mode in ("disagg", "spill"):
            float_front_end(procs[-1], workdir / "llm.log", cpus)
    except BaseException:
        stop(procs)
        raise
    return url, procs


def workloads(args: argparse.Namespace) -> tuple[Workload, Workload]:
    sizes = bench_serving.parse_image_sizes(args.serving_sizes)
    burst = Workload(args.burst_images, sizes, "png", 16, args.burst_tokens, seed=args.seed)
    chat = Workload(0, sizes, "png", 32, args.chat_tokens, seed=args.seed)
    return burst, chat


async def drive(url: str, model: str, requests: list, offsets: list[float], cap: int | None):
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        payloads = [bench_serving.build_payload(r, model, ignore_eos=True) for r in requests]
        chat_url = url + "/v1/chat/completions"
        return await bench_serving.run_requests(session, chat_url, payloads, {}, offsets, cap)


async def model_id(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await bench_serving.first_model_id(session, url, {})


async def run_stream(stream: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    burst, chat = workloads(args)
    model = await model_id(url)
    warm = bench_serving.generate_requests(burst, 2, bench_serving.WARMUP_STREAM)
    await drive(url, model, warm, [0.0, 0.0], None)
    bursts = bench_serving.generate_requests(burst, args.bursts)
    if stream == "encoder-heavy":
        records, took = await drive(url, model, bursts, [0.0] * len(bursts), args.concurrency)
        return {"all": bench_serving.summarize(records, took)}
    offsets = [args.burst_at + i * args.burst_gap for i in range(len(bursts))]
    started = time.perf_counter()
    done = asyncio.Event()

    async def bursts_then_stop() -> tuple[list, float]:
        try:
            return await drive(url, model, bursts, offsets, None)
        finally:
            done.set()

    sent_chats, (burst_records, _) = await asyncio.gather(
        chat_loops(url, model, chat, args.chats, done), bursts_then_stop()
    )
    took = time.perf_counter() - started
    chat_records = [r for _, r in sent_chats]
    return {
        "all": bench_serving.summarize(chat_records + burst_records, took),
        "chats": bench_serving.summarize(chat_records, took),
        "bursts": bench_serving.summarize(burst_records, took),
        "chats_in_bursts": gaps_in_window(sent_chats, burst_window(burst_records, offsets)),
    }


async def chat_loops(
    url: str, model: str, chat: Workload, loops: int, done: asyncio.Event
) -> list[tuple[float, Any]]:
    """`loops` clients, each sending text chats one after another from t = 0 until `done` (the
    last burst answered): chats decode through the whole bursts' window whatever a chat's
    length and the decode's speed. (send time from the start, record) per chat."""
    timeout = aiohttp.ClientTimeout(total=1800)
    chat_url, start = url + "/v1/chat/completions", time.perf_counter()
    out: list[tuple[float, Any]] = []

    async def loop(index: int, session: aiohttp.ClientSession) -> None:
        for n in itertools.count():
            if done.is_set():
                return
            request = bench_serving.make_request(chat, bench_serving.MEASURED_STREAM,
                                                 n * loops + index)  # fmt: skip
            body = json.dumps(bench_serving.build_payload(request, model, ignore_eos=True))
            sent = time.perf_counter() - start
            record = await bench_serving.send_request(session, chat_url, body.encode(), {})
            out.append((sent, record))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(loop(i, session) for i in range(loops)))
    return out


def burst_window(bursts: list, offsets: list[float]) -> tuple[float, float]:
    """From the first burst sent to the last one answered (seconds from the stream's start)."""
    return min(offsets), max(offset + r.latency for offset, r in zip(offsets, bursts))


def gaps_in_window(chats: list[tuple[float, Any]], window: tuple[float, float]) -> dict:
    """The inter-token gaps of the chats (sent at the given times) that end inside `window`,
    in ms: the decode the bursts stall, without the quiet decode before and after them."""
    start, end = window
    gaps = []
    for sent, r in chats:
        at = sent + r.ttft
        for gap in r.itl:
            at += gap
            if start <= at <= end:
                gaps.append(gap)
    return bench_serving.describe_ms(gaps)


def main(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Any]:
    """Run every mode on every stream; print the table; the results by "mode/stream"."""
    results = serving_benchmark(args, model, workdir)
    print("\n".join([*table(results), *pool_lines(results)]))
    if args.plot:
        plot(results, args.plot)
    return results


def serving_benchmark(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stream in STREAMS:
        for mode in args.modes.split(","):
            folder = workdir / f"{mode}-{stream}"
            folder.mkdir(parents=True, exist_ok=True)
            url, procs = launch(mode, model, folder)
            try:
                results[f"{mode}/{stream}"] = out = asyncio.run(run_stream(stream, url, args))
                if pool := encoder_pool_info(url):
                    out["encoder_pool"] = pool
            finally:
                stop(procs)
            print(f"done: {mode} {stream}", flush=True)
    return results


def encoder_pool_info(url: str) -> dict[str, int] | None:
    """The LLM server's counts of items sent to its encoder servers and of requests spilled to
    its own tower (the warm-up pair included); None without encoder servers."""
    media = httpx.get(url + "/server_info", timeout=30).json().get("media") or {}
    pool = media.get("encoder_servers")
    if pool is None:
        return None
    return {"items_sent": pool["items_sent"], "spilled_requests": pool["spilled_requests"]}


def pool_lines(results: dict[str, Any]) -> list[str]:
    return [f"{name}: {out['encoder_pool']['items_sent']} items sent to the encoder servers, "
            f"{out['encoder_pool']['spilled_requests']} requests spilled to the LLM's tower"
            for name, out in results.items() if "encoder_pool" in out]  # fmt: skip


def ms(summary: dict[str, Any], key: str, stat: str) -> str:
    value = summary[key][stat]
    return "-" if value is None else f"{value:.0f}"


def table(results: dict[str, Any]) -> list[str]:
    lines = ["| mode | stream | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | chats' ITL p50 "
             "| chats' ITL p99 | chats' ITL p99 in bursts | bursts' TTFT p50 | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, out in results.items():
        mode, stream = name.split("/")
        s, chats, bursts = out["all"], out.get("chats"), out.get("bursts")
        extra = ["-", "-", "-", "-"]
        if chats is not None:
            during = {"itl_ms": out.get("chats_in_bursts", {"p99": None})}
            extra = [ms(chats, "itl_ms", "median"), ms(chats, "itl_ms", "p99"),
                     ms(during, "itl_ms", "p99"), ms(bursts, "ttft_ms", "median")]  # fmt: skip
        row = [mode, stream, f"{s['request_throughput']:.2f}", ms(s, "ttft_ms", "median"),
               ms(s, "ttft_ms", "p99"), ms(s, "itl_ms", "median"), ms(s, "itl_ms", "p99"),
               *extra, str(s["failed"])]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(results: dict[str, Any], path: str) -> None:
    """Per mode: requests/s of each stream; TTFT and ITL p50 / p99 of the encoder-heavy stream;
    the mixed stream's chats' ITL and bursts' TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(name.split("/")[0] for name in results))
    fig, (rate, heavy, mixed) = plt.subplots(3, 1, figsize=(9, 10))
    bars(rate, modes, {s: [results.get(f"{m}/{s}", {}).get("all", {}).get("request_throughput")
                           for m in modes] for s in STREAMS}, "requests/s")  # fmt: skip
    bars(heavy, modes, latencies(results, modes, "encoder-heavy", "all", "all"), "ms (log)")
    bars(mixed, modes, latencies(results, modes, "mixed", "chats", "bursts"), "ms (log)")
    heavy.set_title("encoder-heavy stream", fontsize=9)
    mixed.set_title("mixed stream: chats' ITL, bursts' TTFT", fontsize=9)
    for ax in (heavy, mixed):
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path)


def latencies(results: dict, modes: list[str], stream: str, itl_of: str, ttft_of: str) -> dict:
    def stat(mode: str, part: str, key: str, which: str) -> float | None:
        out = results.get(f"{mode}/{stream}", {}).get(part)
        return None if out is None else out[key][which]

    out = {f"{label} {which}": [stat(m, part, key, which) for m in modes]
           for label, part, key in (("TTFT", ttft_of, "ttft_ms"), ("ITL", itl_of, "itl_ms"))
           for which in ("median", "p99")}  # fmt: skip
    if stream == "mixed":
        runs = [results.get(f"{m}/{stream}", {}).get("chats_in_bursts") for m in modes]
        out["ITL p99 in bursts"] = [None if r is None else r["p99"] for r in runs]
    return out


def bars(ax: Any, modes: list[str], series: dict[str, list], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(modes))]
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serving", action="store_true", help="the serving benchmark (module doc)")
    p.add_argument("--modes", default=",".join(MODES), help="serving: disagg, dp, tp, tp1, spill")
    p.add_argument("--serving-image-sizes", dest="serving_sizes", default="224x224,336x224")
    p.add_argument("--burst-images", type=int, default=4, help="serving: images per request")
    p.add_argument("--bursts", type=int, default=8, help="serving: image requests per stream")
    p.add_argument("--burst-tokens", type=int, default=8)
    p.add_argument("--burst-at", type=float, default=2.0, help="mixed: first burst (s)")
    p.add_argument("--burst-gap", type=float, default=0.5, help="mixed: between bursts (s)")
    p.add_argument("--chats", type=int, default=4, help="mixed: clients sending text chats")
    p.add_argument("--chat-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4, help="encoder-heavy: in flight")



if __name__ == "__main__":  # the same as bench_vit_dp_vs_tp.py --serving
    import bench_vit_dp_vs_tp

    bench_vit_dp_vs_tp.main(["--serving", *sys.argv[1:]])
