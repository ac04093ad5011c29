"""tessera against a peer (vLLM's CPU build or plain transformers) on the same checkpoint, side by
side, in alternating rounds, with each server's CPU per request.

    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --preset hd64 --out /tmp/hd64
    python scripts/bench_vs_vllm.py --model-path /tmp/hd64 --rounds 3 --json hd64.json --md hd64.md
    python scripts/bench_vs_vllm.py --model-path /tmp/hd64 --quick          # a short smoke run
    python scripts/bench_vs_vllm.py --model-path /tmp/hd64 --greedy-check   # text vs transformers
    python scripts/make_tiny_checkpoint.py --arch internvl --preset hd64 --out /tmp/internvl-hd64
    python scripts/bench_vs_vllm.py --model-path /tmp/internvl-hd64 --workload image1  # any family
    python scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --preset vit-hd64 --out /tmp/vit-hd64
    python scripts/bench_vs_vllm.py --model-path /tmp/hd64 --tp2-model-path /tmp/vit-hd64
    python scripts/bench_vs_vllm.py --peer transformers --model-path /tmp/tiny --workload image1
    python scripts/bench_vs_vllm.py --model-path /tmp/hd64 --group variants \
        --variant "base@../main=" --workload decode      # this checkout against another one

The peer is vLLM unless --peer transformers: then it is scripts/hf_reference_server.py (HF
`generate` behind the same chat API, one request at a time) and the tp2 group compares both of
tessera's encoder modes against it.

vLLM runs from its own virtualenv (--vllm-python, default /tmp/vllm-venv/bin/python, built by
`../shared/tools/setup_vllm_cpu.sh`); this project's venv never imports it. Only one server runs
at a time: every round starts each server of a group in turn (the order rotates every round),
waits for /health, warms it with requests of the same shapes but other images and text, runs
each workload of the group once with the round's seed, and stops it (SIGINT to its process
group, SIGKILL after a grace period: vLLM's engine and worker processes go with it). Both
servers get the same request bodies from the same client (`bench_serving.py`'s generator,
streaming runner and metrics), at temperature 0 with ignore_eos, so both generate the same
number of tokens.

Groups and workloads (--quick: 4 requests each, at most 8 output tokens, 1 round):
  tp1   tessera (`launch.py`, defaults) against the peer (defaults)
        image1        32 chats of one image (448x448 or 224x336), 32 words, 32 tokens, 16 at a time
        images3       16 chats of three images (224 to 448 px), 16 words, 16 tokens, 8 at a time
        shared-image  32 chats on one shared 448x448 image, 32 words, 16 tokens, 16 at a time
        decode        32 text chats, 32 words, 128 tokens, 16 at a time
        long-prompt   8 text chats of about 3.4k prompt tokens, 8 tokens, 2 at a time
        mixed         48 chats (text 64 tokens, one image 32 tokens, alternating), Poisson 4/s,
                      at most 16 in flight
  tp2   the ViT DP-vs-TP comparison: tessera --tp 2 with and without --mm-enable-dp-encoder,
        vLLM --tensor-parallel-size 2 --mm-encoder-tp-mode data / weights (Gloo on CPU; vLLM's
        CPU workers bound one per core with VLLM_CPU_OMP_THREADS_BIND, as its automatic binding
        wants one NUMA node per rank); on --tp2-model-path when given (an encoder-heavy
        checkpoint: the vit-hd64 preset), else on --model-path; the segments a stopped vLLM
        leaves in /dev/shm are removed
        vit-tp2       16 chats of four images (112 to 672 px), 16 words, 1 token, 4 at a time
  variants  (only when named) tessera with its defaults against tessera with the flags of each
        `--variant NAME=FLAGS`, on the tp1 workloads, ratios variant / defaults; e.g.
        --group variants --variant "mixed-b1024=--enable-mixed-chunk
        --max-encoder-patches-per-step 1024" --workload mixed; `--variant NAME@DIR=FLAGS`
        starts the launch.py of the checkout at DIR instead of this one's

Per workload and server the report gives the median over rounds of requests/s, output tokens/s,
TTFT and ITL p50/p99, and the ratio of each pair's medians (tessera / peer; within one server,
DP / TP), and, read from /proc around each measured run, the CPU per request of the server's
main process and of its whole process tree and the minor page faults of tessera's rank 0
scheduler. --cpus-per-server N runs the server on N CPUs of its own and the client on the rest.
--json writes every run and the summary; --md writes the markdown tables.

--greedy-check sends a fixed set of text and image chats (greedy, no ignore_eos) to each server
in turn, then runs transformers' own `generate` on the same checkpoint (the reference server's
input builder) and reports, per chat, whether each server's text equals transformers' and
whether the servers' prompt_tokens agree. A vLLM text that equals transformers' less a trailing
incomplete UTF-8 character (shown by transformers as U+FFFD) is reported as such, not as a
mismatch: vLLM holds that character back until it completes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench_serving  # noqa: E402
from bench_serving import BenchRequest, Workload  # noqa: E402

from runtime.cpus import usable_cpus  # noqa: E402

TESSERA, VLLM, TRANSFORMERS = "tessera", "vllm", "transformers"
PEERS = (VLLM, TRANSFORMERS)
DEFAULT_VLLM_PYTHON = "/tmp/vllm-venv/bin/python"
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "PYTHONPATH": "",  # tessera's top-level packages (kernels, runtime...) must not shadow vLLM's
}
QUICK_PROMPTS = 4
QUICK_OUTPUT_LEN = 8
WARMUP_SEED_OFFSET = 1_000_000
ROUND_SEED_STEP = 1_000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STOP_GRACE_S = 30.0
STARTED_CHILD = re.compile(r"started (\S+) \(pid (\d+)\)")


# ---------------------------------------------------------------- the harness: /proc, servers


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


# ---------------------------------------------------------------- workloads (pure)


@dataclass(frozen=True)
class Scenario:
    """One workload: requests cycle through `parts`; `shared_image` gives all request 0's images."""

    name: str
    parts: tuple[Workload, ...]
    num_prompts: int
    concurrency: int
    rate: float = math.inf
    shared_image: bool = False


def chat(images: int, sizes: str, words: int, tokens: int) -> Workload:
    return Workload(images, bench_serving.parse_image_sizes(sizes), "png", words, tokens, seed=0)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("image1", (chat(1, "448x448,224x336", 32, 32),), 32, 16),
        Scenario("images3", (chat(3, "224x224,336x336,448x448", 16, 16),), 16, 8),
        Scenario("shared-image", (chat(1, "448x448", 32, 16),), 32, 16, shared_image=True),
        Scenario("decode", (chat(0, "1x1", 32, 128),), 32, 16),
        Scenario("long-prompt", (chat(0, "1x1", 1000, 8),), 8, 2),
        Scenario(
            "mixed", (chat(0, "1x1", 32, 64), chat(1, "448x448,224x336", 32, 32)), 48, 16, rate=4.0
        ),
        Scenario(
            "vit-tp2", (chat(4, "112x112,224x224,336x336,448x448,560x560,672x672", 16, 1),), 16, 4
        ),
    )
}


def quick(scenario: Scenario) -> Scenario:
    """The same shapes, fewer requests and tokens: a smoke run of every code path."""
    parts = tuple(
        replace(p, output_len=min(p.output_len, QUICK_OUTPUT_LEN)) for p in scenario.parts
    )
    count = min(scenario.num_prompts, QUICK_PROMPTS)
    return replace(scenario, parts=parts, num_prompts=count)


def build_requests(scenario: Scenario, seed: int, stream: int) -> list[BenchRequest]:
    """Request i follows part i % len(parts); its images and text come from (seed, stream, i)."""
    parts = [replace(p, seed=seed) for p in scenario.parts]
    out = [
        bench_serving.make_request(parts[i % len(parts)], stream, i)
        for i in range(scenario.num_prompts)
    ]
    if scenario.shared_image and out:
        first = out[0]
        out = [replace(r, image_urls=first.image_urls, image_sizes=first.image_sizes) for r in out]
    return out


# ---------------------------------------------------------------- servers


@dataclass(frozen=True)
class ServerSpec:
    name: str
    kind: str  # TESSERA, VLLM or TRANSFORMERS
    flags: tuple[str, ...] = ()
    checkout: str | None = None  # a tessera server from another checkout's launch.py


@dataclass(frozen=True)
class Group:
    servers: tuple[ServerSpec, ...]
    scenarios: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]  # (numerator, denominator) of each ratio
    checkpoint: str = "model_path"  # the argument naming the group's checkpoint


TP1_SCENARIOS = ("image1", "images3", "shared-image", "decode", "long-prompt", "mixed")
TESSERA_TP2 = (
    ServerSpec("tessera-tp2-dp", TESSERA, ("--tp", "2", "--mm-enable-dp-encoder")),
    ServerSpec("tessera-tp2-tp", TESSERA, ("--tp", "2")),
)
VLLM_TP2 = ("--tensor-parallel-size", "2", "--mm-encoder-tp-mode")


def peer_groups(peer: str) -> dict[str, Group]:
    """The tp1 and tp2 comparisons against one peer: vLLM's CPU build (its tp 2 in both encoder
    modes) or plain transformers `generate` (one request at a time, no tp: it serves the tp 2
    group's checkpoint once, against both of tessera's encoder modes)."""
    dp, tp = (s.name for s in TESSERA_TP2)
    tp1 = Group((ServerSpec(TESSERA, TESSERA), ServerSpec(peer, peer)), TP1_SCENARIOS,
                ((TESSERA, peer),))  # fmt: skip
    if peer == TRANSFORMERS:
        servers = (*TESSERA_TP2, ServerSpec(peer, peer))
        pairs = ((dp, peer), (tp, peer), (dp, tp))
        return {"tp1": tp1, "tp2": Group(servers, ("vit-tp2",), pairs, "tp2_model_path")}
    data = ServerSpec("vllm-tp2-data", VLLM, (*VLLM_TP2, "data"))
    weights = ServerSpec("vllm-tp2-weights", VLLM, (*VLLM_TP2, "weights"))
    pairs = ((dp, data.name), (tp, weights.name), (dp, tp), (data.name, weights.name))
    return {"tp1": tp1, "tp2": Group((*TESSERA_TP2, data, weights), ("vit-tp2",), pairs,
                                     "tp2_model_path")}  # fmt: skip


GROUPS = peer_groups(VLLM)
VARIANTS = "variants"


def variants_group(variants: Sequence[str]) -> Group:
    """tessera with its defaults against tessera with other flags (`NAME=FLAGS` each), on the
    tp 1 group's workloads: what a flag changes, measured side by side in alternating rounds.
    `NAME@DIR=FLAGS` runs the launch.py of the checkout at DIR: two versions side by side."""
    specs = []
    for variant in variants:
        label, sep, flags = variant.partition("=")
        name, _, checkout = label.partition("@")
        if not sep or not name or name in (TESSERA, *PEERS):
            raise SystemExit(f"--variant {variant!r}: give NAME[@DIR]=FLAGS, NAME not a server's")
        specs.append(ServerSpec(name, TESSERA, tuple(shlex.split(flags)), checkout or None))
    if not specs:
        raise SystemExit("--group variants needs at least one --variant NAME=FLAGS")
    servers = (ServerSpec(TESSERA, TESSERA), *specs)
    return Group(servers, GROUPS["tp1"].scenarios, tuple((s.name, TESSERA) for s in specs))


def tp_size(flags: Sequence[str]) -> int:
    for name in ("--tp", "--tensor-parallel-size"):
        if name in flags:
            return int(flags[list(flags).index(name) + 1])
    return 1


def vllm_env(flags: Sequence[str], cpus: Sequence[int] | None = None) -> dict[str, str]:
    """vLLM's CPU workers bind their OpenMP threads per NUMA node unless told which CPUs to use;
    with one node and tp > 1 its start fails, so rank r gets CPU r (mod the usable count)."""
    size = tp_size(flags)
    if size == 1:
        return dict(VLLM_ENV)
    cpus = sorted(cpus or os.sched_getaffinity(0))
    binding = "|".join(str(cpus[r % len(cpus)]) for r in range(size))
    return {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": binding}


def tessera_server(
    name: str, flags: Sequence[str], model_path: str, log_dir: Path, checkout: str | None = None
) -> Server:
    """`launch.py` of this checkout (or of `checkout`) on `model_path`, `--device cpu` unless
    the flags name a device."""
    flags = [*flags] if "--device" in flags else [*flags, "--device", "cpu"]
    argv = [sys.executable, "launch.py", "--model-path", model_path, *flags]
    cwd = Path(checkout).resolve() if checkout else ROOT
    return Server(name, argv, log_dir / f"{name}.log", cwd=cwd)


def make_server(
    spec: ServerSpec, args: argparse.Namespace, model_path: str | None = None
) -> Server:
    """The server of `spec` on `model_path` (default: the tp 2 checkpoint for tp > 1, else
    --model-path), on the CPUs of --cpus-per-server when given."""
    if model_path is None:
        model_path = args.tp2_model_path if tp_size(spec.flags) > 1 else args.model_path
    cpus = getattr(args, "server_cpus", None)
    if spec.kind == TESSERA:
        server = tessera_server(spec.name, spec.flags, model_path, args.log_dir, spec.checkout)
    elif spec.kind == TRANSFORMERS:
        argv = [sys.executable, str(ROOT / "scripts/hf_reference_server.py"),
                "--model-path", model_path, "--device", "cpu"]  # fmt: skip
        server = Server(spec.name, argv, args.log_dir / f"{spec.name}.log")
    else:
        argv = [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(model_path).resolve()), "--dtype", "float32",
            "--max-model-len", "4096", "--limit-mm-per-prompt", '{"image": 4}', *spec.flags,
        ]  # fmt: skip
        env = vllm_env(spec.flags, cpus)
        server = Server(spec.name, argv, args.log_dir / f"{spec.name}.log", env=env,
                        cwd=args.log_dir.resolve())  # fmt: skip
    server.cpus = cpus
    return server


def pin_client(per_server: int) -> list[int]:
    """The server's CPUs (the first `per_server` usable ones); this process keeps the rest."""
    cpus = usable_cpus()
    if len(cpus) <= per_server:
        raise SystemExit(f"--cpus-per-server {per_server} needs {per_server + 1} CPUs")
    os.sched_setaffinity(0, cpus[per_server:])
    return cpus[:per_server]


SHM = Path("/dev/shm")
VLLM_SHM_PREFIX = "vllm"  # its tp > 1 shared-memory broadcast segments, e.g. vllm_dist_...


def shm_names() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def remove_new_segments(before: set[str], prefix: str) -> list[str]:
    """Unlink the /dev/shm entries named `prefix...` that appeared since `before` (what a killed
    server left behind); returns their names."""
    left = sorted(n for n in shm_names() - before if n.startswith(prefix))
    for name in left:
        with contextlib.suppress(OSError):
            (SHM / name).unlink()
    return left


@contextmanager
def running(server: Server, ready_timeout: float) -> Iterator[Server]:
    """The server, started and healthy; stopped (its whole process group) however the block ends,
    and the shared-memory segments vLLM's ranks made removed (a stopped tp 2 vLLM leaves them)."""
    before = shm_names()
    try:
        server.start()
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()
        remove_new_segments(before, VLLM_SHM_PREFIX)


# ---------------------------------------------------------------- one measured run


def client_session(timeout_s: float) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0), trust_env=False
    )


async def drive(
    url: str, requests: Sequence[BenchRequest], scenario: Scenario, seed: int
) -> dict[str, Any]:
    """Send the requests (Poisson at the scenario's rate, capped concurrency); bench_serving's
    summary of the run."""
    async with client_session(600.0) as session:
        model = await bench_serving.first_model_id(session, url, {})
        payloads = [bench_serving.build_payload(r, model, ignore_eos=True) for r in requests]
        offsets = bench_serving.arrival_offsets(len(payloads), scenario.rate, seed)
        endpoint = f"{url}/v1/chat/completions"
        records, duration = await bench_serving.run_requests(
            session, endpoint, payloads, {}, offsets, scenario.concurrency
        )
    return bench_serving.summarize(records, duration)


def run_row(server: str, scenario: str, seed: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one run that the summary keeps."""
    return {
        "server": server,
        "scenario": scenario,
        "seed": seed,
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "errors": metrics["errors"],
        "prompt_tokens": metrics["total_input_tokens"],
        "req_s": metrics["request_throughput"],
        "out_tok_s": metrics["output_throughput"],
        "ttft_p50_ms": metrics["ttft_ms"]["median"],
        "ttft_p99_ms": metrics["ttft_ms"]["p99"],
        "itl_p50_ms": metrics["itl_ms"]["median"],
        "itl_p99_ms": metrics["itl_ms"]["p99"],
        "tpot_p50_ms": metrics["tpot_ms"]["median"],
    }


def measure(server: Server, scenario: Scenario, seed: int, warmup: int) -> dict[str, Any]:
    if warmup:
        warm = replace(scenario, num_prompts=warmup, rate=math.inf)
        requests = build_requests(warm, seed + WARMUP_SEED_OFFSET, bench_serving.WARMUP_STREAM)
        asyncio.run(drive(server.url, requests, warm, seed))
    requests = build_requests(scenario, seed, bench_serving.MEASURED_STREAM)
    before = server.costs()
    metrics = asyncio.run(drive(server.url, requests, scenario, seed))
    spent = costs_per_request(before, server.costs(), metrics["completed"])
    return run_row(server.name, scenario.name, seed, metrics) | spent


def costs_per_request(
    before: dict[str, float], after: dict[str, float], requests: int
) -> dict[str, float]:
    """What the server's processes spent between two readings of `Server.costs`, per request:
    CPU of the main process (HTTP and front end; all of the transformers server) and of the
    whole process tree in ms, and the minor page faults of tessera's rank 0 scheduler."""
    n = max(requests, 1)
    return {
        "main_cpu_ms_per_req": 1e3 * (after["main_cpu_s"] - before["main_cpu_s"]) / n,
        "tree_cpu_ms_per_req": 1e3 * (after["tree_cpu_s"] - before["tree_cpu_s"]) / n,
        "scheduler_faults_per_req": (
            after["scheduler_minor_faults"] - before["scheduler_minor_faults"]
        ) / n,
    }


# ---------------------------------------------------------------- summary (pure)

METRICS = (
    "req_s", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms"
)  # fmt: skip
COSTS = ("main_cpu_ms_per_req", "tree_cpu_ms_per_req", "scheduler_faults_per_req")


def median_or_none(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def summarize(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(scenario, server) -> the median over rounds of every metric, the rounds and failures."""
    keys = sorted({(r["scenario"], r["server"]) for r in runs})
    out = {}
    for key in keys:
        mine = [r for r in runs if (r["scenario"], r["server"]) == key]
        row = {m: median_or_none([r.get(m) for r in mine]) for m in (*METRICS, *COSTS)}
        out[key] = row | {"rounds": len(mine), "failed": sum(r["failed"] for r in mine)}
    return out


def pair_ratios(
    summary: dict[tuple[str, str], dict[str, Any]], scenario: str, pair: tuple[str, str]
) -> dict[str, float | None] | None:
    """Every metric's median of pair[0] over pair[1]'s (throughput: > 1 is better for pair[0];
    latency: < 1 is); None when either server has no run of `scenario`."""
    a, b = summary.get((scenario, pair[0])), summary.get((scenario, pair[1]))
    if a is None or b is None:
        return None
    return {m: ratio(a[m], b[m]) for m in METRICS}


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def per_server_table(
    summary: dict[tuple[str, str], dict[str, Any]],
    head: str,
    cells: Callable[[dict[str, Any]], list[str]],
) -> str:
    """One markdown row per (workload, server) of the summary, its cells from `cells`."""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (scenario, server), r in summary.items():
        lines.append(f"| {scenario} | {server} | {' | '.join(cells(r))} |")
    return "\n".join(lines)


def metrics_table(summary: dict[tuple[str, str], dict[str, Any]]) -> str:
    head = (
        "| workload | server | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | TPOT p50 ms | rounds | failed |"
    )

    def cells(r: dict[str, Any]) -> list[str]:
        latencies = [fmt(r[m], 1) for m in METRICS[2:]]
        return [fmt(r["req_s"]), fmt(r["out_tok_s"], 1), *latencies, str(r["rounds"]),
                str(r["failed"])]  # fmt: skip

    return per_server_table(summary, head, cells)


def costs_table(summary: dict[tuple[str, str], dict[str, Any]]) -> str:
    head = (
        "| workload | server | main-process CPU ms/req | process-tree CPU ms/req "
        "| scheduler minor faults/req |"
    )

    def cells(r: dict[str, Any]) -> list[str]:
        return [fmt(r["main_cpu_ms_per_req"], 1), fmt(r["tree_cpu_ms_per_req"], 0),
                fmt(r["scheduler_faults_per_req"], 0)]  # fmt: skip

    return per_server_table(summary, head, cells)


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| workload | ratio | req/s | out tok/s | TTFT p99 | ITL p99 |"
    lines = [head, "|" + "---|" * 6]
    for row in rows:
        r = row["ratios"]
        cells = [fmt(r[m]) + "x" if r[m] is not None else "-" for m in ("req_s", "out_tok_s")]
        cells += [fmt(r[m]) for m in ("ttft_p99_ms", "itl_p99_ms")]
        lines.append(
            f"| {row['scenario']} | {row['pair'][0]} / {row['pair'][1]} | {' | '.join(cells)} |"
        )
    return "\n".join(lines)


def ratio_rows(
    summary: dict[tuple[str, str], dict[str, Any]], groups: Sequence[Group]
) -> list[dict[str, Any]]:
    rows = []
    for group in groups:
        for scenario in group.scenarios:
            for pair in group.pairs:
                ratios = pair_ratios(summary, scenario, pair)
                if ratios is not None:
                    rows.append({"scenario": scenario, "pair": list(pair), "ratios": ratios})
    return rows


def markdown(summary: dict[tuple[str, str], dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    note = (
        "Medians over rounds. Ratios are the first server's median over the second's: above 1 is "
        "better for req/s and tok/s, below 1 for the latencies."
    )
    tables = [metrics_table(summary), ratio_table(rows), costs_table(summary)]
    return "\n\n".join([*tables, note]) + "\n"


# ---------------------------------------------------------------- the benchmark


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    shift %= max(len(items), 1)
    return [*items[shift:], *items[:shift]]


def run_group(group: Group, args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    scenarios = [SCENARIOS[n] for n in group.scenarios if not args.workload or n in args.workload]
    if not scenarios:
        return  # no workload of this group was asked for: its servers are not started
    if args.quick:
        scenarios = [quick(s) for s in scenarios]
    servers = [s for s in group.servers if not args.server or s.name in args.server]
    for r in range(args.rounds):
        for spec in rotated(servers, r):
            server = make_server(spec, args, getattr(args, group.checkpoint))
            with running(server, args.ready_timeout):
                for scenario in scenarios:
                    run = measure(server, scenario, args.seed + r * ROUND_SEED_STEP, args.warmup)
                    runs.append(run | {"round": r})
                    print(progress_line(run, r), flush=True)


def progress_line(run: dict[str, Any], round_index: int) -> str:
    return (
        f"round {round_index} {run['scenario']} {run['server']}: {run['req_s']:.2f} req/s, "
        f"{run['out_tok_s']:.1f} tok/s, ttft p99 {fmt(run['ttft_p99_ms'], 0)} ms, "
        f"failed {run['failed']} {run['errors'][:1]}"
    )


def conditions(argv: Sequence[str]) -> dict[str, Any]:
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_start": os.getloadavg(),
        "command": "python scripts/bench_vs_vllm.py " + " ".join(argv),
    }


def benchmark(args: argparse.Namespace, argv: Sequence[str]) -> int:
    info = conditions(argv)
    peer = peer_groups(args.peer)
    groups = [
        variants_group(args.variant) if name == VARIANTS else peer[name] for name in args.group
    ]
    runs: list[dict[str, Any]] = []
    for group in groups:
        run_group(group, args, runs)
    info["load_average_end"] = os.getloadavg()
    summary = summarize(runs)
    rows = ratio_rows(summary, groups)
    text = markdown(summary, rows)
    print(text)
    if args.md is not None:
        args.md.write_text(text)
    if args.json is not None:
        table = [{"scenario": s, "server": n, **row} for (s, n), row in summary.items()]
        payload = info | {"summary": table, "ratios": rows, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


# ---------------------------------------------------------------- greedy cross-check

GREEDY_MAX_TOKENS = 32
REPLACEMENT_CHAR = "\ufffd"
GREEDY_TEXTS = (
    "Describe a quiet morning by the river.",
    "Count from one to ten and explain each number.",
    "Write three short lines about a stone bridge.",
    "What colors do you see in the sky at sunset?",
)


def greedy_cases() -> list[dict[str, Any]]:
    """Chat bodies (non-streamed, greedy, no ignore_eos): text, one image, two images."""
    rng = np.random.default_rng(7)
    bodies = [[{"type": "text", "text": t}] for t in GREEDY_TEXTS]
    for sizes in (((224, 224),), ((448, 336),), ((112, 112), (336, 224))):
        images = [
            {"type": "image_url", "image_url": {"url": bench_serving.image_data_url(
                bench_serving.make_image(rng, size), "png")}}
            for size in sizes
        ]  # fmt: skip
        bodies.append([*images, {"type": "text", "text": "Describe the image."}])
    return [
        {"messages": [{"role": "user", "content": c}], "max_tokens": GREEDY_MAX_TOKENS,
         "temperature": 0.0}
        for c in bodies
    ]  # fmt: skip


async def ask_all(url: str, bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body in turn: {"text", "prompt_tokens"} or {"error"}."""
    out = []
    async with client_session(600.0) as session:
        model = await bench_serving.first_model_id(session, url, {})
        for body in bodies:
            async with session.post(
                f"{url}/v1/chat/completions", json=body | {"model": model}
            ) as r:
                reply = json.loads(await r.read())
            if r.status != 200:
                out.append({"error": f"HTTP {r.status}: {bench_serving.error_message(reply)}"})
                continue
            text = reply["choices"][0]["message"]["content"] or ""
            out.append({"text": text, "prompt_tokens": reply["usage"]["prompt_tokens"]})
    return out


def transformers_answers(model_path: str, bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers' own greedy `generate`, inputs built as the reference server builds them."""
    import torch
    from hf_reference_server import Reference

    ref = Reference(model_path, "cpu", torch.float32)
    out = []
    for body in bodies:
        inputs = ref.inputs(body["messages"])
        with torch.inference_mode():
            ids = ref.model.generate(**inputs, max_new_tokens=GREEDY_MAX_TOKENS, do_sample=False)
        prompt = int(inputs["input_ids"].shape[1])
        text = ref.tokenizer.decode(ids[0, prompt:], skip_special_tokens=True)
        out.append({"text": text, "prompt_tokens": prompt})
    return out


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character (the shorter length when one is a prefix)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verdict(answer: dict[str, Any], expected: str) -> str:
    """'equal', 'held back partial UTF-8' or 'differs at char N'."""
    if "error" in answer:
        return f"error: {answer['error']}"
    text = answer["text"]
    if text == expected:
        return "equal"
    if expected.endswith(REPLACEMENT_CHAR) and text == expected.rstrip(REPLACEMENT_CHAR):
        return "equal less a trailing partial UTF-8 char (held back)"
    return f"differs at char {first_difference(text, expected)}"


def greedy_rows(
    answers: dict[str, list[dict[str, Any]]], expected: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = []
    for i, hf in enumerate(expected):
        per_server = {name: a[i] for name, a in answers.items()}
        prompts = {name: a.get("prompt_tokens") for name, a in per_server.items()}
        rows.append(
            {
                "case": i,
                "transformers": hf,
                "servers": per_server,
                "verdicts": {name: verdict(a, hf["text"]) for name, a in per_server.items()},
                "prompt_tokens_equal": len(set(prompts.values())) == 1,
                "prompt_tokens": prompts | {"transformers": hf["prompt_tokens"]},
            }
        )
    return rows


def greedy_table(rows: Sequence[dict[str, Any]]) -> str:
    names = list(rows[0]["servers"]) if rows else []
    head = "| case | prompt tokens (" + ", ".join([*names, "HF"]) + ") | servers agree | "
    head += " | ".join(f"{n} vs HF" for n in names) + " |"
    lines = [head, "|" + "---|" * (3 + len(names))]
    for r in rows:
        tokens = ", ".join(str(v) for v in r["prompt_tokens"].values())
        cells = " | ".join(r["verdicts"][n] for n in names)
        lines.append(f"| {r['case']} | {tokens} | {r['prompt_tokens_equal']} | {cells} |")
    return "\n".join(lines)


def run_greedy_check(args: argparse.Namespace) -> int:
    bodies = greedy_cases()
    answers = {}
    for spec in peer_groups(args.peer)["tp1"].servers:
        with running(make_server(spec, args), args.ready_timeout) as server:
            answers[spec.name] = asyncio.run(ask_all(server.url, bodies))
    rows = greedy_rows(answers, transformers_answers(args.model_path, bodies))
    print(greedy_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"greedy": rows}, indent=2) + "\n")
    tessera_ok = all(r["verdicts"][TESSERA] == "equal" for r in rows)
    return 0 if tessera_ok and all(r["prompt_tokens_equal"] for r in rows) else 1


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a checkpoint (head_dim 64 for vLLM)")
    p.add_argument(
        "--tp2-model-path", default=None,
        help="checkpoint of the tp 2 group (default: --model-path); an encoder-heavy one with "
        "head_dim 64: make_tiny_checkpoint.py --arch qwen2_5_vl --preset vit-hd64",
    )  # fmt: skip
    p.add_argument(
        "--peer", choices=PEERS, default=VLLM,
        help="the server tessera is measured against: vLLM's CPU build or plain transformers "
        "(scripts/hf_reference_server.py)",
    )  # fmt: skip
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of vLLM's venv")
    p.add_argument(
        "--group", action="append", choices=[*sorted(GROUPS), VARIANTS], default=None,
        help="which comparison (repeatable; default: tp1 and tp2); variants: tessera against "
        "tessera with the flags of each --variant",
    )  # fmt: skip
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="with --group variants: a tessera server named NAME started with FLAGS, e.g. "
        "mixed='--enable-mixed-chunk' (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--server", action="append", default=None,
        help="run only the servers of this name (repeatable), e.g. tessera",
    )  # fmt: skip
    p.add_argument(
        "--workload", action="append", choices=sorted(SCENARIOS), default=None,
        help="run only this workload (repeatable), e.g. long-prompt",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before each workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 requests a workload, 1 round")
    p.add_argument("--greedy-check", action="store_true", help="compare greedy text, no timing")
    p.add_argument(
        "--cpus-per-server", type=int, default=0,
        help="run each server on N CPUs of its own (taskset) and the client on the rest, so "
        "neither takes the other's CPU time (0: both share every CPU)",
    )  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench_vs_vllm_logs"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None, help="write the markdown tables here")
    args = p.parse_args(argv)
    args.group = args.group or sorted(GROUPS)
    args.tp2_model_path = args.tp2_model_path or args.model_path
    if args.quick:
        args.rounds, args.warmup = 1, min(args.warmup, 1)
    return args


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `running` block stops its server."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
    if args.cpus_per_server:
        args.server_cpus = pin_client(args.cpus_per_server)
    if args.greedy_check:
        return run_greedy_check(args)
    return benchmark(args, argv)


if __name__ == "__main__":
    sys.exit(main())
