"""CPU per process per request: where a serving workload's CPU goes, tessera or vLLM.

    python scripts/profile_serving_cpu.py --model-path /tmp/vit-hd64 --server tessera-tp2-dp
    python scripts/profile_serving_cpu.py --model-path /tmp/vit-hd64 --server vllm-tp2-data

Starts one server of bench_vs_vllm.py's groups (the same flags, environment and clean-up), warms
it, then sends --rounds rounds of a workload (default vit-tp2), each with fresh seeds so no image
is cached, and reads every process's user + system CPU from /proc before and after. Prints per
process its CPU in milliseconds per request and its share of the server's CPU; for tessera also
the /server_info counters that moved (encoder calls, items encoded, prefill steps). On a machine
where every core is busy, throughput is the inverse of the CPU a request costs: this says whose
CPU it is.

    /tmp/vllm-venv/bin/pip install py-spy      # into vLLM's venv, not the project's
    python scripts/profile_serving_cpu.py --model-path /tmp/hd64 --server vllm --workload decode \
        --py-spy --running 16 --output-len 512

--py-spy instead splits a vLLM server's time by phase: it keeps --running chats of the workload
in flight (--output-len tokens each), and once they run records every vLLM process with py-spy
for --seconds (idle threads included, without pausing the process), reads the engine's step
count from its /metrics (vllm:iteration_tokens_total) before and after, and prints per process
the share of wall time in each phase and that share as milliseconds per engine step. A sample
counts in a phase when any of its frames is one of the phase's functions (the first that
matches, in the order listed), else as "other"; a thread with no sample in any phase (socket
and pool threads, blocked nearly all the time) is left out. In the API process "other" is
mostly uvloop's event loop waiting in C. For tessera, run py-spy on the pids printed without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402
import bench_vs_vllm as bench  # noqa: E402
from bench_vs_vllm import STARTED_CHILD, proc_stat, process_tree  # noqa: E402

SERVERS = {
    spec.name: spec
    for peer in bench.PEERS
    for group in bench.peer_groups(peer).values()
    for spec in group.servers
}


@dataclass(frozen=True)
class ProcessCost:
    pid: int
    name: str
    ms_per_request: float
    share: float  # of the server's CPU over the measured rounds


def cpu_per_request(
    before: Mapping[int, float],
    after: Mapping[int, float],
    names: Mapping[int, str],
    requests: int,
) -> list[ProcessCost]:
    """Each process's CPU between the two readings, per request, busiest first (pure)."""
    spent = {pid: after.get(pid, 0.0) - before.get(pid, 0.0) for pid in before}
    total = sum(spent.values()) or 1.0
    rows = [
        ProcessCost(pid, names.get(pid, "?"), 1e3 * s / max(requests, 1), s / total)
        for pid, s in spent.items()
    ]
    return sorted(rows, key=lambda r: -r.ms_per_request)


def moved_counters(before: Any, after: Any, path: str = "") -> dict[str, float]:
    """The numeric leaves of two /server_info answers that changed, as after - before (pure)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: dict[str, float] = {}
        for key, value in before.items():
            out.update(moved_counters(value, after.get(key), f"{path}.{key}".lstrip(".")))
        return out
    numeric = (int, float)
    if isinstance(before, numeric) and isinstance(after, numeric) and before != after:
        if not isinstance(before, bool):
            return {path: after - before}
    return {}


def process_names(root: int, log: Path) -> dict[int, str]:
    """tessera's children by the launcher's log, the rest by their command line."""
    named = {int(pid): name for name, pid in STARTED_CHILD.findall(log.read_text())}
    tree = process_tree(root)
    return {pid: "main" if pid == root else named.get(pid) or command_name(pid) for pid in tree}


def command_name(pid: int) -> str:
    """A spawned Python worker (tessera's media workers) by its role, else the command name."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    line = cmdline(pid)
    for marker, role in (("resource_tracker", "resource tracker"), ("spawn_main", "worker")):
        if marker in line:
            return role
    return comm


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def server_info(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as reply:
            return json.load(reply)
    except OSError:  # vLLM has no /server_info
        return {}


def warm_up(server: Any, args: argparse.Namespace) -> None:
    warm = replace(bench.SCENARIOS[args.workload], num_prompts=args.warmup)
    warm_requests = bench.build_requests(warm, args.seed + 1, bench_serving.WARMUP_STREAM)
    asyncio.run(bench.drive(server.url, warm_requests, warm, args.seed))


def measure(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    scenario = bench.SCENARIOS[args.workload]
    warm_up(server, args)
    names = process_names(server.proc.pid, server.log)
    cpu0, info0 = {p: proc_stat(p).cpu_s for p in names}, server_info(server.url)
    for r in range(args.rounds):
        seed = args.seed + bench.ROUND_SEED_STEP * (r + 2)
        requests = bench.build_requests(scenario, seed, bench_serving.MEASURED_STREAM)
        summary = asyncio.run(bench.drive(server.url, requests, scenario, seed))
        print(f"round {r}: {summary['request_throughput']:.2f} req/s")
    cpu1 = {p: proc_stat(p).cpu_s for p in names}
    rows = cpu_per_request(cpu0, cpu1, names, args.rounds * scenario.num_prompts)
    return {"processes": [vars(row) for row in rows],
            "counters": moved_counters(info0, server_info(server.url))}  # fmt: skip


# ---------------------------------------------------------------- --py-spy: vLLM's phases


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
PY_SPY = "/tmp/vllm-venv/bin/py-spy"  # vLLM's venv


def process_kind(cmdline: str) -> str:
    """A vLLM process's kind by its command line."""
    if "EngineCore" in cmdline:
        return "engine"
    if "api_server" in cmdline:
        return "api"
    if "resource_tracker" in cmdline:
        return "tracker"
    return "worker"


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


def running_scenario(args: argparse.Namespace) -> bench.Scenario:
    """The workload with --running chats in flight (three times as many in all) and
    --output-len tokens each, where given."""
    scenario = bench.SCENARIOS[args.workload]
    if args.output_len:
        parts = tuple(replace(p, output_len=args.output_len) for p in scenario.parts)
        scenario = replace(scenario, parts=parts)
    running = args.running or scenario.concurrency
    return replace(scenario, num_prompts=running * 3, concurrency=running)


def load_in_background(url: str, args: argparse.Namespace) -> threading.Thread:
    scenario = running_scenario(args)
    requests = bench.build_requests(scenario, seed=11, stream=0)
    worker = threading.Thread(target=lambda: asyncio.run(bench.drive(url, requests, scenario, 11)))
    worker.start()
    return worker


def phase_breakdown(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Per vLLM process and thread, the share of wall time in each phase while the load runs."""
    warm_up(server, args)
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


def report(result: dict[str, Any]) -> None:
    for row in result["processes"]:
        print(f"{row['pid']:8d} {row['name'][:24]:24s} {row['ms_per_request']:8.1f} ms/request "
              f"{100 * row['share']:5.1f}%")  # fmt: skip
    total = sum(row["ms_per_request"] for row in result["processes"])
    print(f"{'':8s} {'all':24s} {total:8.1f} ms/request")
    for key, value in result["counters"].items():
        print(f"  {key}: {value:g}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--server", choices=sorted(SERVERS), default="tessera-tp2-dp")
    p.add_argument("--workload", choices=sorted(bench.SCENARIOS), default="vit-tp2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=bench.DEFAULT_VLLM_PYTHON)
    p.add_argument("--py-spy", action="store_true", help="vLLM only: time by phase, per step")
    p.add_argument("--running", type=int, default=0, help="--py-spy: requests in flight")
    p.add_argument("--output-len", type=int, default=0, help="--py-spy: tokens per request")
    p.add_argument("--seconds", type=float, default=15.0, help="--py-spy: recording time")
    p.add_argument("--settle", type=float, default=5.0, help="--py-spy: load before recording")
    p.add_argument("--rate", type=int, default=100, help="--py-spy: samples per second")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("profile_serving_cpu_logs"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.py_spy and SERVERS[args.server].kind != bench.VLLM:
        p.error("--py-spy knows the phases of vLLM's processes only")
    args.tp2_model_path = args.model_path  # what bench_vs_vllm.make_server reads
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench.stop_on_sigterm()
    server = bench.make_server(SERVERS[args.server], args)
    with bench.running(server, args.ready_timeout):
        result = phase_breakdown(server, args) if args.py_spy else measure(server, args)
    if args.py_spy:
        print("\n".join(report_lines(result)))
    else:
        report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
