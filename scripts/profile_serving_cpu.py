"""CPU per process per request: where a serving workload's CPU goes, tessera or vLLM.

    python scripts/profile_serving_cpu.py --model-path /tmp/vit-hd64 --server tessera-tp2-dp
    python scripts/profile_serving_cpu.py --model-path /tmp/vit-hd64 --server vllm-tp2-data

Starts one server of bench_vs_vllm.py's groups (the same flags, environment and clean-up), warms
it, then sends --rounds rounds of a workload (default vit-tp2), each with fresh seeds so no image
is cached, and reads every process's user + system CPU from /proc before and after. Prints per
process its CPU in milliseconds per request and its share of the server's CPU; for tessera also
the /server_info counters that moved (encoder calls, items encoded, prefill steps). On a machine
where every core is busy, throughput is the inverse of the CPU a request costs: this says whose
CPU it is. Run py-spy on the printed pids for the split inside a process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402
import bench_vs_vllm as bench  # noqa: E402
from bench_vs_reference import STARTED_CHILD, proc_stat, process_tree  # noqa: E402

SERVERS = {spec.name: spec for group in bench.GROUPS.values() for spec in group.servers}


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
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    for marker, role in (("resource_tracker", "resource tracker"), ("spawn_main", "worker")):
        if marker in cmdline:
            return role
    return comm


def server_info(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as reply:
            return json.load(reply)
    except OSError:  # vLLM has no /server_info
        return {}


def measure(server: Any, args: argparse.Namespace) -> dict[str, Any]:
    scenario = bench.SCENARIOS[args.workload]
    warm = replace(scenario, num_prompts=args.warmup)
    warm_requests = bench.build_requests(warm, args.seed + 1, bench_serving.WARMUP_STREAM)
    asyncio.run(bench.drive(server.url, warm_requests, warm, args.seed))
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
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("profile_serving_cpu_logs"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.tp2_model_path = args.model_path  # what bench_vs_vllm.make_server reads
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench.stop_on_sigterm()
    server = bench.make_server(SERVERS[args.server], args)
    with bench.running(server, args.ready_timeout):
        result = measure(server, args)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
