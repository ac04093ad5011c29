"""Where vLLM's decode step goes on CPU: py-spy on each of its processes at a fixed batch.

    /tmp/vllm-venv/bin/pip install py-spy      # into vLLM's venv, not the project's
    python scripts/profile_vllm_decode.py --model-path /tmp/hd64 --running 16 --json decode.json

Starts vLLM (as bench_vs_vllm.py does), warms it, then keeps --running text chats decoding
(bench_vs_vllm's decode workload with longer answers, --running at a time). Once they run, it
records every vLLM process with py-spy for --seconds (idle threads included, without pausing the
process), reads the engine's step count from its own /metrics (vllm:iteration_tokens_total)
before and after, and prints per process the share of wall time in each phase and that share
as milliseconds per engine step. A sample counts in a phase when any of its frames is one of the
phase's functions (the first that matches, in the order listed), else as "other"; a thread
with no sample in any phase (socket and pool threads, blocked nearly all the time) is left out.
In the API process "other" is mostly uvloop's event loop waiting in C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_vllm as bench  # noqa: E402
from bench_vs_reference import process_tree  # noqa: E402

# (phase, function names) per process kind, in match order: an inner phase before its caller
PHASES = {
    "worker": (
        ("update states", ("_update_states",)),
        ("input preparation", ("_prepare_inputs", "_preprocess")),
        ("forward", ("_model_forward",)),
        ("sampling", ("_sample",)),
        ("output bookkeeping", ("_bookkeeping_sync", "_to_list")),
        ("other work in execute_model", ("execute_model", "sample_tokens")),
        ("sending the output to the engine", ("enqueue",)),
        ("waiting for the engine (idle)", ("dequeue", "acquire_read", "wait_for_message")),
    ),
    "engine": (
        ("scheduling", ("schedule",)),
        ("output processing", ("update_from_output",)),
        ("handing the step to the worker", ("enqueue",)),
        ("waiting for the worker", ("acquire_read", "execute_model", "sample_tokens")),
    ),
    "api": (
        ("detokenizing and output processing", ("process_outputs",)),
        ("chat stream (HTTP, SSE)", ("chat_completion_stream_generator", "send")),
    ),
}
STEP_METRIC = "vllm:iteration_tokens_total_count"
PY_SPY = "/tmp/vllm-venv/bin/py-spy"


def process_kind(cmdline: str) -> str:
    if "EngineCore" in cmdline:
        return "engine"
    if "api_server" in cmdline:
        return "api"
    if "resource_tracker" in cmdline:
        return "tracker"
    return "worker"


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def phase_of(stack: list[str], phases: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """The first phase (in listed order) one of whose functions is on the stack."""
    names = {frame.split(" ", 1)[0].rsplit(".", 1)[-1] for frame in stack}  # Class.method
    for phase, functions in phases:
        if names.intersection(functions):
            return phase
    return "other"


def phase_samples(raw: str, kind: str) -> dict[str, Counter[str]]:
    """py-spy's raw output with thread ids -> per thread, samples per phase. One line is
    `thread (TID): NAME;Class.f1 (file:line);f2 (file:line);... count`; every thread is
    sampled all the time (idle included), so a thread's shares are shares of wall time."""
    threads: dict[str, Counter[str]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not (stack and count.isdigit()):
            continue
        thread, *frames = stack.split(";")
        phase = phase_of(frames, PHASES.get(kind, ()))
        threads.setdefault(thread, Counter())[phase] += int(count)
    return threads


def record(pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen:
    argv = [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)),
            "--rate", str(rate), "--idle", "--threads", "--nonblocking",
            "--format", "raw", "--output", str(out)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def scrape_steps(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(STEP_METRIC)
    )


def load_in_background(url: str, args: argparse.Namespace) -> threading.Thread:
    decode = bench.SCENARIOS["decode"]
    parts = tuple(replace(p, output_len=args.output_len) for p in decode.parts)
    scenario = replace(decode, parts=parts, num_prompts=args.running * 3, concurrency=args.running)
    requests = bench.build_requests(scenario, seed=11, stream=0)
    worker = threading.Thread(target=lambda: asyncio.run(bench.drive(url, requests, scenario, 11)))
    worker.start()
    return worker


def breakdown(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    load = load_in_background(server.url, args)
    time.sleep(args.settle)
    pids = {pid: process_kind(cmdline(pid)) for pid in process_tree(server.proc.pid)}
    pids = {pid: kind for pid, kind in pids.items() if kind != "tracker"}
    files = {pid: args.log_dir / f"pyspy-{kind}-{pid}.txt" for pid, kind in pids.items()}
    steps_before, start = scrape_steps(server.url), time.monotonic()
    spies = [record(pid, args.seconds, args.rate, files[pid]) for pid in pids]
    for spy in spies:
        spy.wait()
    steps = scrape_steps(server.url) - steps_before
    window = time.monotonic() - start
    load.join()
    step_ms = window / steps * 1000 if steps else None
    out = {"window_s": window, "steps": steps, "step_ms": step_ms, "processes": []}
    for pid, kind in pids.items():
        raw = files[pid].read_text() if files[pid].exists() else ""
        for thread, counts in phase_samples(raw, kind).items():
            if set(counts) == {"other"}:
                continue  # a thread with none of the phases' functions: helpers, pools
            total = sum(counts.values())
            shares = {phase: n / total for phase, n in counts.most_common()}
            row = {"pid": pid, "kind": kind, "thread": thread, "samples": total}
            out["processes"].append(row | {"shares": shares})
    return out


def report_lines(result: dict[str, Any]) -> list[str]:
    step = result["step_ms"]
    lines = [f"{result['steps']:.0f} engine steps in {result['window_s']:.1f} s: "
             f"{bench.fmt(step)} ms per step"]  # fmt: skip
    for proc in result["processes"]:
        lines.append(
            f"{proc['kind']} pid {proc['pid']} {proc['thread']}: {proc['samples']} samples"
        )
        for phase, share in proc["shares"].items():
            per_step = bench.fmt(share * step) if step else "-"
            lines.append(f"  {phase:<40}{share * 100:6.1f}%  {per_step:>8} ms/step")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--vllm-python", default=bench.DEFAULT_VLLM_PYTHON)
    p.add_argument("--running", type=int, default=16, help="requests decoding at once")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load before recording")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("profile_vllm_logs"))
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench.stop_on_sigterm()
    spec = bench.ServerSpec(bench.VLLM, bench.VLLM)
    with bench.running(bench.make_server(spec, args), args.ready_timeout) as server:
        warm = bench.quick(bench.SCENARIOS["decode"])
        asyncio.run(bench.drive(server.url, bench.build_requests(warm, 5, 1), warm, 5))
        result = breakdown(server, args)
    print("\n".join(report_lines(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
