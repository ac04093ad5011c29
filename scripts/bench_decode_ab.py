"""Decode-heavy serving, two checkouts of tessera side by side: interleaved rounds, medians.

    python scripts/bench_decode_ab.py --base /path/to/old/checkout --rounds 3 \\
        --model-path /tmp/hd64 --json out.json

Each round starts the server of each checkout in turn (the order alternates between rounds),
warms it, then drives it with this checkout's `scripts/bench_serving.py`: `--concurrency` text
chats at a time (`--prompts` of them, `--output-len` tokens each, ignore_eos), then one stream
alone (`--single` requests). Reported per checkout: the median over rounds of output tokens/s,
TPOT and of the single stream's inter-token latency, the ratio this/base, and the load average
seen at every run (the machine may be shared: read ratios, not absolute numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s} s")


def start_server(tree: Path, model_path: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "launch.py", "--model-path", model_path, "--host", "127.0.0.1"]
    with log.open("ab") as out:
        return subprocess.Popen(
            [*cmd, "--port", str(port)], cwd=tree, env=env, stdout=out, stderr=out
        )


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def drive(url: str, out: Path, prompts: int, concurrency: int, args: argparse.Namespace) -> dict:
    """One bench_serving run against url; its JSON report's metrics."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_serving.py"),
        "--base-url", url,
        "--images-per-request", "0",
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency),
        "--warmup", "0",
        "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["metrics"]


def one_run(tree: Path, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, float]:
    """Start `tree`'s server, warm it, measure both workloads, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tree, args.model_path, port, tmp / f"{tag}.log")
    try:
        wait_healthy(url, proc)
        drive(url, tmp / "warm.json", args.concurrency, args.concurrency, args)
        load = os.getloadavg()[0]
        many = drive(url, tmp / f"{tag}_many.json", args.prompts, args.concurrency, args)
        one = drive(url, tmp / f"{tag}_one.json", args.single, 1, args)
    finally:
        stop_server(proc)
    return {
        "output_tok_s": many["output_throughput"],
        "tpot_ms": many["tpot_ms"]["median"],
        "single_itl_ms": one["itl_ms"]["median"],
        "load_1min": load,
    }


def summarize(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    keys = ("output_tok_s", "tpot_ms", "single_itl_ms")
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()
    }
    lines = [f"{'metric':<16}{'base':>10}{'this':>10}{'this/base':>11}"]
    for k in keys:
        base, this = med["base"][k], med["this"][k]
        lines.append(f"{k:<16}{base:>10.2f}{this:>10.2f}{this / base:>11.3f}")
    for name, rs in runs.items():
        loads = ", ".join(f"{r['load_1min']:.1f}" for r in rs)
        lines.append(f"load average (1 min) at each {name} run: {loads}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. main)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64, help="words of text per chat")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    trees = {"base": args.base.resolve(), "this": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["base", "this"] if r % 2 == 0 else ["this", "base"]
            for name in order:
                runs[name].append(one_run(trees[name], args, Path(tmp), f"{name}{r}"))
                print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    print("\n".join(summarize(runs)))
    if args.json is not None:
        report = {"trees": {k: str(v) for k, v in trees.items()}, "runs": runs}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
