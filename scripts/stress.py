"""Seeded stress test of a whole tessera server (issue 10: the server never falls over).

    python scripts/stress.py --minutes 10 --tp 2 --mm-enable-dp-encoder

It starts `launch.py` on the built-in tiny checkpoint with a KV pool small enough to force
retraction, chunked prefill small enough to cut images, and (unless --fault-injection-rate 0)
per-request faults injected by the suite's tests/fault_injection.py (the server is then started
through the test-only entry point tests/fault_server.py, which hands the injector to launch.main
and so through the scheduler's test seam, scheduler/input_checks.py), then sends for the given
time (or a given number of requests per client, --requests), from several client threads with
random arrivals: text and image requests (a few images, repeated; identical prompts), random
max_tokens, streaming and not, extreme sampling values, invalid requests, and clients that hang
up at every stage (waiting, prefill, decode, mid-stream).

Checks, each a line of the summary and a non-zero exit when one fails:
- the server stays up and /health answers 200 after the load;
- every greedy /generate request that completes equals that request run alone (token ids);
- after the load: free + evictable == total KV, no radix lock, no encoder-cache pin, no request
  slot held, nothing queued or in flight, no child process beyond the ones at the start;
- stopping the server leaves no process behind within --stop-seconds (10 s by default).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the fault injector, its server entry point, the attacks: test code
sys.path[:0] = [str(ROOT), str(TESTS)]

from hostile_load import AttackLoad  # noqa: E402

from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402

TEXTS = ["Describe the picture.", "What colour is it?", "Tell a story about a cat.", "Hi"]
MAX_TOKENS = 48
EXTREMES = [
    {"temperature": 1e-39},
    {"top_p": 1e-50},
    {"temperature": 2.0, "top_p": 1.0},
    {"top_k": 1},
    {"min_p": 1.0},
    {"temperature": 0.7, "seed": 123},
]


# ---------------------------------------------------------------------- server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """launch.py with the given flags, in its own session, so that every process it starts can be
    found, and checked gone, through its process group."""

    def __init__(self, flags: list[str], log: Path, entry: Path = ROOT / "launch.py"):
        """`entry`: the script that serves (launch.py, or tests/fault_server.py with faults)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, str(entry), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            cmd,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy:\n{self.log.read_text()[-4000:]}")

    def children(self) -> list[int]:
        """Every live process under the server's main process, children's children included
        (the media workers are forked by the media fork server, a child of the main process)."""
        out, todo = [], [self.proc.pid]
        while todo:
            for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
                try:
                    found = [int(pid) for pid in task.read_text().split()]
                except OSError:
                    continue
                out += found
                todo += found
        return out

    def group_alive(self) -> bool:
        return group_alive(self.proc.pid)


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, 0)
        return True
    return False


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def stop_and_time(server: LaunchedServer) -> float:
    """SIGTERM; seconds until the whole process group is gone (killed after 30 s)."""
    start = time.monotonic()
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    while server.group_alive() and time.monotonic() - start < 30:
        server.proc.poll()
        time.sleep(0.1)
    took = time.monotonic() - start
    if server.group_alive():
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    return took


def stress_flags(opts: argparse.Namespace, folder: Path) -> list[str]:
    """The settings that make the load hard: retraction, images cut by chunks, faults."""
    flags = ["--model-path", str(folder), "--tp", str(opts.tp), "--device", "cpu"]
    flags += ["--max-total-tokens", str(opts.kv_tokens), "--chunked-prefill-size", "64"]
    flags += ["--max-running-requests", "12", "--max-queued-requests", str(opts.max_queued)]
    flags += ["--random-seed", str(opts.seed), "--log-level", "warning"]
    return flags + (["--mm-enable-dp-encoder"] if opts.mm_enable_dp_encoder else [])


def stress_server(opts: argparse.Namespace, folder: Path, log: Path) -> LaunchedServer:
    """The server under load: launch.py, or with faults asked for, the suite's test-only entry
    point that hands the fault injector to every scheduler rank."""
    flags = stress_flags(opts, folder)
    if opts.fault_injection_rate <= 0:
        return LaunchedServer(flags, log)
    faults = ["--fault-rate", str(opts.fault_injection_rate), "--fault-seed", str(opts.seed)]
    return LaunchedServer([*faults, *flags], log, TESTS / "fault_server.py")


# ---------------------------------------------------------------------- workload


def png_url(seed: int, size: tuple[int, int]) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Prompt:
    text: str
    image: str | None  # data URL


def prompts() -> list[Prompt]:
    images = [png_url(0, (56, 56)), png_url(1, (84, 112)), png_url(2, (168, 168))]
    out = [Prompt(t, None) for t in TEXTS]
    out += [Prompt(t, img) for img in images for t in TEXTS[:2]]
    return out


@dataclass
class Stats:
    sent: Counter = field(default_factory=Counter)
    status: Counter = field(default_factory=Counter)
    greedy_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.sent[kind] += 1
            self.status[outcome] += 1


class Load:
    def __init__(self, url: str, seed: int, refs: dict[int, list[int]], pool: list[Prompt]):
        self.url, self.seed, self.refs, self.pool = url, seed, refs, pool
        self.stats = Stats()

    def native_body(self, i: int, max_new: int, params: dict) -> dict:
        p = self.pool[i]
        body = {"text": p.text, "sampling_params": {"max_new_tokens": max_new, **params}}
        if p.image:
            body["image_data"] = p.image
        return body

    def chat_body(self, i: int, max_tokens: int, params: dict, stream: bool) -> dict:
        p = self.pool[i]
        content: list[dict] = [{"type": "text", "text": p.text}]
        if p.image:
            content.insert(0, {"type": "image_url", "image_url": {"url": p.image}})
        messages = [{"role": "user", "content": content}]
        return {"messages": messages, "max_tokens": max_tokens, "stream": stream, **params}

    def one(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.pool))
        max_new = rng.randint(1, MAX_TOKENS)
        hang_up = rng.random() < 0.15  # the client leaves at a random moment
        timeout = rng.uniform(0.05, 3.0) if hang_up else 120.0
        roll = rng.random()
        if roll < 0.45:
            self.greedy(i, max_new, timeout)
        elif roll < 0.7:
            params = rng.choice(EXTREMES) | {"ignore_eos": rng.random() < 0.5}
            body = self.chat_body(i, max_new, params, stream=False)
            self.post("chat", "/v1/chat/completions", body, timeout)
        elif roll < 0.95:
            body = self.chat_body(i, max_new, rng.choice(EXTREMES), stream=True)
            self.stream(body, rng.randint(1, MAX_TOKENS + 2), timeout)
        else:
            body = self.chat_body(i, 0, {}, stream=False)  # invalid: 400 expected
            self.post("invalid", "/v1/chat/completions", body, timeout, expect=400)

    def greedy(self, i: int, max_new: int, timeout: float) -> None:
        params = {"temperature": 0, "ignore_eos": True}
        resp = self.post("greedy", "/generate", self.native_body(i, max_new, params), timeout)
        if resp is None or resp.status_code != 200:
            return
        got, want = resp.json()["output_ids"], self.refs[i][:max_new]
        with self.stats.lock:
            self.stats.greedy_checked += 1
            if got != want:
                self.stats.mismatches.append(f"prompt {i} max {max_new}: {got} != {want}")

    def post(
        self, kind: str, path: str, body: dict, timeout: float, expect: int | None = None
    ) -> httpx.Response | None:
        try:
            resp = httpx.post(self.url + path, json=body, timeout=timeout)
        except httpx.TimeoutException:
            self.stats.note(kind, "client_hung_up")
            return None
        self.stats.note(kind, str(resp.status_code))
        self.check_error(kind, resp, expect)
        return resp

    def check_error(self, kind: str, resp: httpx.Response, expect: int | None) -> None:
        ok = {expect} if expect else {200, 500, 503}  # 500: injected fault; 503: queue full
        if resp.status_code not in ok:
            with self.stats.lock:
                self.stats.unexpected.append(f"{kind}: {resp.status_code} {resp.text[:200]}")
        elif resp.status_code != 200 and set(resp.json()["error"]) != {
            "message",
            "type",
            "param",
            "code",
        }:
            self.stats.unexpected.append(f"{kind}: not OpenAI error JSON: {resp.text[:200]}")

    def stream(self, body: dict, read_events: int, timeout: float) -> None:
        """Read `read_events` events, then hang up (or read to the end if there are fewer)."""
        outcome = "200"
        try:
            with httpx.stream(
                "POST", self.url + "/v1/chat/completions", json=body, timeout=timeout
            ) as r:
                outcome = str(r.status_code)
                if r.status_code == 200:
                    outcome = self.read_stream(r, read_events)
                else:
                    r.read()
                    self.check_error("stream", r, None)
        except httpx.TimeoutException:
            outcome = "client_hung_up"
        self.stats.note("stream", outcome)

    def read_stream(self, r: httpx.Response, read_events: int) -> str:
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                return "stream_error_event"
            if line == "data: [DONE]":
                return "200"
            if line.startswith("data:"):
                events += 1
                if events >= read_events:
                    return "client_hung_up_mid_stream"
        with self.stats.lock:
            self.stats.unexpected.append("stream ended without [DONE]")
        return "stream_cut"

    def worker(self, index: int, until: float, mean_gap: float, count: int) -> None:
        """Send requests until `until` (monotonic seconds), or `count` of them when count > 0."""
        rng = random.Random(self.seed * 1000 + index)
        sent = 0
        while sent < count if count > 0 else time.monotonic() < until:
            sent += 1
            time.sleep(rng.expovariate(1 / mean_gap))
            try:
                self.one(rng)
            except Exception as exc:  # noqa: BLE001 - any client-side surprise is a finding
                with self.stats.lock:
                    self.stats.unexpected.append(f"client error: {exc!r}")


def references(url: str, pool: list[Prompt]) -> dict[int, list[int]]:
    """Each prompt's greedy tokens, run alone before the load."""
    load = Load(url, 0, {}, pool)
    refs = {}
    for i in range(len(pool)):
        body = load.native_body(i, MAX_TOKENS, {"temperature": 0, "ignore_eos": True})
        for _ in range(20):  # an injected fault may hit the reference too: run it again
            resp = httpx.post(url + "/generate", json=body, timeout=120)
            if resp.status_code == 200:
                refs[i] = resp.json()["output_ids"]
                break
        else:
            raise RuntimeError(f"no reference for prompt {i}: {resp.text}")
    return refs


# ---------------------------------------------------------------------- checks


def idle_info(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        quiet = info["running"] == 0 and info["waiting"] == 0 and info["api"]["in_flight"] == 0
        if quiet or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def after_load_checks(server: LaunchedServer, children_before: int) -> tuple[dict[str, bool], dict]:
    info = idle_info(server.url)
    health = httpx.get(server.url + "/health", timeout=10).status_code
    return {
        "server_alive": server.proc.poll() is None and health == 200,
        "nothing_running_or_queued": info["running"] == 0 and info["waiting"] == 0,
        "nothing_in_flight": info["api"]["in_flight"] == 0,
        "kv_free_plus_evictable_is_total": info["kv_free"] + info["kv_evictable"]
        == info["kv_total"],
        "no_radix_lock": info["kv_protected"] == 0,
        "no_encoder_pin": info["encoder_cache"]["pins"] == 0,
        "no_req_slot": info["req_slots_used"] == 0,
        "no_extra_child": len(server.children()) <= children_before,
    }, info


def run(opts: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="tessera-stress-"))
    folder = make_checkpoint("qwen2_vl", work / "qwen2_vl")
    log = work / "server.log"
    server = stress_server(opts, folder, log)
    try:
        server.wait_healthy()
        pool = prompts()
        refs = references(server.url, pool)
        attackers = AttackLoad(server.url, opts.kv_tokens) if opts.attacks else None
        if attackers is not None:
            attackers.warm_up()
        children = len(server.children())
        load = Load(server.url, opts.seed, refs, pool)
        until = time.monotonic() + opts.minutes * 60
        threads = [
            threading.Thread(target=load.worker, args=(k, until, opts.mean_gap, opts.requests))
            for k in range(opts.clients)
        ]
        started = time.monotonic()
        if attackers is not None:
            threads.append(threading.Thread(target=attackers.run))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_seconds = time.monotonic() - started
        checks, info = after_load_checks(server, children)
    finally:
        stop_s = stop_and_time(server)
    checks["stopped_in_time"] = stop_s < opts.stop_seconds
    checks["greedy_outputs_match"] = not load.stats.mismatches
    checks["no_unexpected_response"] = not load.stats.unexpected
    attacked = attackers.summary() if attackers is not None else None
    if attacked is not None:
        checks["attacks_answered_as_their_own"] = not attacked["problems"]
        checks["control_never_failed"] = attacked["control_failed"] == 0
        if opts.control_bound > 0:
            checks["control_within_bound"] = attacked["control_max_s"] < opts.control_bound
    summary = {
        "minutes": opts.minutes,
        "requests_per_client": opts.requests,
        "tp": opts.tp,
        "dp_encoder": opts.mm_enable_dp_encoder,
        "seed": opts.seed,
        "requests": sum(load.stats.sent.values()),
        "load_seconds": round(load_seconds, 2),
        "requests_per_s": round(sum(load.stats.sent.values()) / load_seconds, 3),
        "by_kind": dict(load.stats.sent),
        "outcomes": dict(load.stats.status),
        "greedy_checked": load.stats.greedy_checked,
        "scheduler": {
            k: info["counters"][k]
            for k in ("finished", "aborted", "retractions", "failed", "faults_injected", "refused")
        },
        "stop_seconds": round(stop_s, 2),
        "checks": checks,
        "mismatches": load.stats.mismatches[:5],
        "unexpected": load.stats.unexpected[:5],
        "log": str(server.log),
        "attacks": attacked,
    }
    print(json.dumps(summary, indent=2))
    return 0 if all(checks.values()) else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mm-enable-dp-encoder", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument(
        "--requests", type=int, default=0,
        help="requests per client instead of --minutes (a load of fixed size, however fast)",
    )
    parser.add_argument("--mean-gap", type=float, default=0.3, help="seconds between requests")
    parser.add_argument("--kv-tokens", type=int, default=None, help="400; 4000 with --attacks")
    parser.add_argument(
        "--attacks", action="store_true",
        help="also send issue 57's hostile requests (tests/hostile_load.py), one after another, "
        "with a control chat every 0.5 s whose latency the summary reports",
    )
    parser.add_argument(
        "--control-bound", type=float, default=0.0,
        help="with --attacks: fail unless every control chat took less than this many seconds",
    )
    parser.add_argument("--max-queued", type=int, default=8)
    parser.add_argument("--fault-injection-rate", type=float, default=0.01)
    parser.add_argument(
        "--stop-seconds", type=float, default=10.0,
        help="how long stopping the server may take (it is killed after 30 s)",
    )
    opts = parser.parse_args(argv)
    if opts.kv_tokens is None:
        opts.kv_tokens = 4000 if opts.attacks else 400
    return opts


if __name__ == "__main__":
    sys.exit(run(parse()))
