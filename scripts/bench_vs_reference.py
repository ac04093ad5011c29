"""tessera against plain HF transformers, side by side in one run, with each server's CPU cost.

    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --preset vit-heavy --out /tmp/vit-heavy
    python scripts/bench_vs_reference.py --model-path /tmp/vit-heavy --workload prefill --rounds 3
    python scripts/bench_vs_reference.py --model-path /tmp/vit-heavy --workload decode --rounds 3

Starts every server once on free loopback ports: `scripts/hf_reference_server.py` ("reference",
HF `generate`, one request at a time) and one `launch.py` per tessera configuration. Then, for
each round, loads each server in turn (the order rotates every round) with `bench_serving.py`'s
workload, so slow drift of the machine falls on every server alike. Every round uses its own
image seed, so no server answers from a cache that an earlier round filled; a short warm-up with
other images goes before each measured run.

Around each measured run it reads /proc: CPU seconds of the server's main process (the HTTP
server and TokenizerManager; for the reference, its only process) and of the whole process tree,
and the minor page faults of the TP rank 0 scheduler. It prints, per server, the median over
rounds of the request rate, its ratio to the reference's median, TTFT, ITL p99, and those costs
per request, and writes everything to --json.

Workloads (those of the overhead issue):
  prefill  16 requests of 4 distinct images (112 to 672 px), 16 words, max_tokens 1, concurrency 4
  decode   32 requests of one image (448x448 or 224x336), 32 words, 32 output tokens, concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench_serving  # noqa: E402

from runtime.cpus import usable_cpus  # noqa: E402

WORKLOADS = {
    "prefill": [
        "--num-prompts", "16", "--images-per-request", "4",
        "--image-sizes", "112x112,224x224,336x336,448x448,560x560,672x672",
        "--input-len", "16", "--output-len", "1", "--max-concurrency", "4",
    ],
    "decode": [
        "--num-prompts", "32", "--images-per-request", "1", "--image-sizes", "448x448,224x336",
        "--input-len", "32", "--output-len", "32", "--max-concurrency", "16",
    ],
}  # fmt: skip
DEFAULT_SERVERS = {
    "prefill": ["reference", "tp1=--tp 1", "tp2-dp=--tp 2 --mm-enable-dp-encoder"],
    "decode": ["reference", "tp1=--tp 1", "tp1-mixed=--tp 1 --enable-mixed-chunk"],
}
REFERENCE = "reference"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STOP_GRACE_S = 30.0
STARTED_CHILD = re.compile(r"started (\S+) \(pid (\d+)\)")


# ---------------------------------------------------------------- /proc


@dataclass(frozen=True)
class ProcStat:
    cpu_s: float
    minor_faults: int


def proc_stat(pid: int) -> ProcStat:
    """CPU seconds (user + system) and minor faults of one process; zeros once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ProcStat(0.0, 0)
    fields = text.rsplit(")", 1)[1].split()  # the fields after the command name
    return ProcStat((int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[7]))


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except OSError:
                continue
    return out


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    argv: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    cpus: list[int] | None = None  # its own CPUs (with --cpus-per-server), inherited by children
    env: dict[str, str] = field(default_factory=dict)  # set over the inherited environment
    cwd: Path = ROOT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        argv = [*self.argv, "--port", str(self.port)]
        if self.cpus is not None:
            argv = ["taskset", "--cpu-list", ",".join(map(str, self.cpus)), *argv]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited while starting; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout_s:.0f} s; see {self.log}")

    def scheduler_pid(self) -> int | None:
        """TP rank 0's scheduler, from the launcher's log; None for the reference server."""
        for name, pid in STARTED_CHILD.findall(self.log.read_text()):
            if name == "scheduler-TP0":
                return int(pid)
        return None

    def costs(self) -> dict[str, float]:
        main = proc_stat(self.proc.pid)
        tree = [proc_stat(pid) for pid in process_tree(self.proc.pid)]
        sched = self.scheduler_pid()
        return {
            "main_cpu_s": main.cpu_s,
            "tree_cpu_s": sum(s.cpu_s for s in tree),
            "scheduler_minor_faults": proc_stat(sched).minor_faults if sched else 0,
        }

    def stop(self) -> None:
        """End the whole process group: also children left behind when the leader already exited
        (a server that spawns engine or rank processes); SIGKILL what outlives the grace period."""
        if self.proc is None:
            return
        signal_group(self.proc.pid, signal.SIGINT)
        if not self.wait_group_gone(STOP_GRACE_S):
            signal_group(self.proc.pid, signal.SIGKILL)
            self.wait_group_gone(STOP_GRACE_S)
        self.proc.wait()  # the leader is gone or a zombie by now: reap it

    def wait_group_gone(self, timeout_s: float) -> bool:
        """Reap the leader and wait until no process of its group runs; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.proc.poll()
            if not group_alive(self.proc.pid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (a zombie leader does not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def make_server(spec: str, model_path: str, log_dir: Path) -> Server:
    """`reference`, or `NAME=LAUNCH ARGS` for a tessera server (`--device cpu` unless given)."""
    if spec == REFERENCE:
        argv = [sys.executable, "scripts/hf_reference_server.py", "--model-path", model_path]
        return Server(REFERENCE, argv, log_dir / "reference.log")
    name, _, extra = spec.partition("=")
    flags = shlex.split(extra)
    if "--device" not in flags:
        flags += ["--device", "cpu"]
    argv = [sys.executable, "launch.py", "--model-path", model_path, *flags]
    return Server(name, argv, log_dir / f"{name}.log")


def pin_servers(servers: list[Server], per_server: int) -> None:
    """Server i runs on its own `per_server` CPUs; this process (the client) keeps the rest."""
    cpus = usable_cpus()
    needed = per_server * len(servers) + 1
    if len(cpus) < needed:
        raise SystemExit(f"--cpus-per-server {per_server} needs {needed} CPUs; {len(cpus)} usable")
    for i, server in enumerate(servers):
        server.cpus = cpus[i * per_server : (i + 1) * per_server]
    os.sched_setaffinity(0, cpus[per_server * len(servers) :])


# ---------------------------------------------------------------- one measured run


def run_bench(server: Server, workload: str, seed: int, num_prompts: int | None) -> dict:
    argv = [*WORKLOADS[workload], "--base-url", server.url, "--warmup", "0", "--seed", str(seed)]
    if num_prompts is not None:
        argv += ["--num-prompts", str(num_prompts)]
    return asyncio.run(bench_serving.benchmark(bench_serving.parse_args(argv)))


def measure(server: Server, workload: str, seed: int, warmup: int) -> dict[str, Any]:
    if warmup:
        run_bench(server, workload, seed + 1_000_000, warmup)  # other images, same shapes
    before = server.costs()
    report = run_bench(server, workload, seed, None)
    after = server.costs()
    m = report["metrics"]
    requests = max(m["completed"], 1)
    per_request = {key: (after[key] - before[key]) / requests for key in before}
    return {
        "server": server.name,
        "seed": seed,
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "req_s": m["request_throughput"],
        "ttft_median_ms": m["ttft_ms"]["median"],
        "itl_p99_ms": m["itl_ms"]["p99"],
        "main_cpu_ms_per_req": per_request["main_cpu_s"] * 1000,
        "tree_cpu_ms_per_req": per_request["tree_cpu_s"] * 1000,
        "scheduler_minor_faults_per_req": per_request["scheduler_minor_faults"],
        "server_breakdown_ms": report.get("server", {}),
    }


# ---------------------------------------------------------------- report


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    by_name = {name: [r for r in runs if r["server"] == name] for name in names}
    ref = median_of(by_name.get(REFERENCE, []), "req_s") if REFERENCE in by_name else None
    rows = []
    for name in names:
        mine = by_name[name]
        rate = median_of(mine, "req_s")
        rows.append(
            {
                "server": name,
                "rounds": len(mine),
                "req_s_median": rate,
                "req_s_all": [round(r["req_s"], 3) for r in mine],
                "vs_reference": rate / ref if ref and rate else None,
                "ttft_median_ms": median_of(mine, "ttft_median_ms"),
                "itl_p99_ms": median_of(mine, "itl_p99_ms"),
                "main_cpu_ms_per_req": median_of(mine, "main_cpu_ms_per_req"),
                "tree_cpu_ms_per_req": median_of(mine, "tree_cpu_ms_per_req"),
                "scheduler_minor_faults_per_req": median_of(mine, "scheduler_minor_faults_per_req"),
                "failed": sum(r["failed"] for r in mine),
            }
        )
    return rows


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| server | req/s median (all rounds) | vs reference | TTFT median ms | ITL p99 ms "
        "| main-process CPU ms/req | process-tree CPU ms/req | scheduler minor faults/req |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        rates = ", ".join(f"{x:.2f}" for x in r["req_s_all"])
        lines.append(
            f"| {r['server']} | {fmt(r['req_s_median'])} ({rates}) | {fmt(r['vs_reference'])}x "
            f"| {fmt(r['ttft_median_ms'], 0)} | {fmt(r['itl_p99_ms'], 0)} "
            f"| {fmt(r['main_cpu_ms_per_req'], 1)} | {fmt(r['tree_cpu_ms_per_req'], 0)} "
            f"| {fmt(r['scheduler_minor_faults_per_req'], 0)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="prefill")
    p.add_argument(
        "--server",
        action="append",
        default=None,
        help="'reference' or NAME=LAUNCH_ARGS (repeatable; default: the workload's three)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before each run")
    p.add_argument("--seed", type=int, default=0, help="round r uses image seed SEED + r")
    p.add_argument(
        "--cpus-per-server",
        type=int,
        default=0,
        help="give each server N CPUs of its own (taskset) and the benchmark client the rest, "
        "so no server or client takes another's CPU time (0: all share every CPU)",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench_vs_reference_logs"))
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    specs = args.server or DEFAULT_SERVERS[args.workload]
    servers = [make_server(spec, args.model_path, args.log_dir) for spec in specs]
    if args.cpus_per_server:
        pin_servers(servers, args.cpus_per_server)
    runs: list[dict[str, Any]] = []
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(args.ready_timeout)
        for r in range(args.rounds):
            order = servers[r % len(servers) :] + servers[: r % len(servers)]
            for server in order:
                run = measure(server, args.workload, args.seed + r, args.warmup)
                runs.append(run)
                print(
                    f"round {r} {server.name}: {run['req_s']:.2f} req/s, "
                    f"main CPU {run['main_cpu_ms_per_req']:.1f} ms/req, "
                    f"scheduler faults {run['scheduler_minor_faults_per_req']:.0f}/req",
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
    rows = summarize(runs, [s.name for s in servers])
    print(table(rows))
    if args.json is not None:
        payload = {"workload": args.workload, "bench_args": WORKLOADS[args.workload]}
        payload |= {"servers": specs, "summary": rows, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
