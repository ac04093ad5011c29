"""Prefill, decode and vision steps with oneDNN-packed linear layers against aten's, side by side.

    python scripts/bench_linear_step.py --model-path /tmp/m100 --threads 1 --rounds 5

One process builds the model twice with the server's factory (`cpu_linear` "onednn" and
"aten", runtime/layers/linear.py), freed memory kept as in the server. Each round, each path in
turn (the order alternating) times: one prefill of a `--prompt-len`-token text prompt (a new
prompt every round, so the prefix cache never serves it), `--steps` decode steps with
`--requests` requests running, the same with one request, and one vision-tower call on a
`--image-patches`-patch image. Reported: medians over rounds of this thread's CPU time (one
thread) or wall time (more threads), and the ratio onednn / aten.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_scheduler_overhead import build  # noqa: E402

from runtime.allocator import keep_freed_memory  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402

PATHS = ("onednn", "aten")


class Bench:
    """One model path's scheduler, with its decode batches admitted once."""

    def __init__(self, model_path: str, cpu_linear: str, args: argparse.Namespace):
        self.scheduler, self.model = build(model_path, args.requests + 2, cpu_linear)
        self.args = args
        self.serial = 0

    def _admit(self, n: int, prompt_len: int, max_new: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        msgs = []
        for _ in range(n):
            self.serial += 1
            ids = [1 + (self.serial * 31 + j * 7) % 300 for j in range(prompt_len)]
            msgs.append(TokenizedGenerateReq(f"r{self.serial}", ids, params))
        self.scheduler.step(msgs)
        while self.scheduler.waiting or self.scheduler.chunked:
            self.scheduler.step([])

    def drain(self) -> None:
        while self.scheduler.running or self.scheduler.waiting:
            self.scheduler.step([])

    def prefill(self) -> None:
        self._admit(1, self.args.prompt_len, 1)
        self.drain()

    def decode(self, n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(self.args.steps):
                self.scheduler.step([])

        self._admit(n, 250, self.args.steps + 2)
        self.scheduler.step([])  # untimed: the first decode step builds the kept K/V blocks
        return run

    def vision(self) -> None:
        side = int(self.args.image_patches**0.5)
        pixels = torch.randn(side * side, self.model.config.vision.patch_dim)
        with torch.inference_mode():
            self.model.visual([pixels], torch.tensor([[1, side, side]]))


def timed(fn: Callable[[], None], threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    begin = clock()
    fn()
    return (clock() - begin) * 1e3


def one_round(bench: Bench, threads: int, steps: int) -> dict[str, float]:
    out = {"prefill": timed(bench.prefill, threads)}
    for n, name in ((bench.args.requests, f"decode x{bench.args.requests}"), (1, "decode x1")):
        run = bench.decode(n)
        out[name] = timed(run, threads) / steps
        bench.drain()
    out["vision"] = timed(bench.vision, threads)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--image-patches", type=int, default=1024)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    benches = {name: Bench(args.model_path, name, args) for name in PATHS}
    for bench in benches.values():
        one_round(bench, args.threads, args.steps)  # warm-up
    times: dict[str, dict[str, list[float]]] = {name: {} for name in PATHS}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in PATHS if r % 2 == 0 else PATHS[::-1]:
            for phase, ms in one_round(benches[name], args.threads, args.steps).items():
                times[name].setdefault(phase, []).append(ms)
    load.append(os.getloadavg()[0])
    print(f"{args.model_path}, {args.threads} thread(s), {args.rounds} rounds, load average "
          f"{load[0]:.1f} -> {load[1]:.1f}; ms ({'CPU' if args.threads == 1 else 'wall'}), "
          "medians\n")
    print("| step | aten (MKL) ms | onednn ms | onednn / aten |")
    print("|---|---|---|---|")
    for phase in times["aten"]:
        a, o = (statistics.median(times[n][phase]) for n in ("aten", "onednn"))
        print(f"| {phase} | {a:.2f} | {o:.2f} | {o / a:.3f} |")


if __name__ == "__main__":
    main()
