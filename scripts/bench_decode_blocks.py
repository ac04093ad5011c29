"""CPU decode step with kept K/V blocks against gathering from the pool, side by side.

    python scripts/bench_decode_blocks.py --model-path /tmp/hd64 --requests 16 --prompt-len 250

One rank in-process (the server's factory, one thread, freed memory kept as in the server), N
text requests decoding together. Rounds alternate between the torch backend's kept blocks
(kernels/attention/running_kv.py) and its gathering path (the blocks' byte budget set to 0);
each round takes one untimed step (the switch rebuilds) and `--steps` timed ones. Reported: the
median over rounds of this thread's CPU time per step (CPU time, not wall time, so that other
work on a shared machine inflates it less) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_scheduler_overhead import build  # noqa: E402

from kernels.attention.running_kv import DEFAULT_MAX_BYTES  # noqa: E402
from runtime.allocator import keep_freed_memory  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402

BUDGETS = {"gather": 0, "kept blocks": DEFAULT_MAX_BYTES}


def start(scheduler: Scheduler, requests: int, prompt_len: int, max_new: int) -> None:
    """Admit the requests and run their prefill."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    msgs = [
        TokenizedGenerateReq(f"r{i}", [1 + (i * 7 + j) % 300 for j in range(prompt_len)], params)
        for i in range(requests)
    ]
    scheduler.step(msgs)
    while scheduler.waiting or scheduler.chunked:
        scheduler.step([])


def cpu_ms_per_step(scheduler: Scheduler, steps: int) -> float:
    scheduler.step([])  # untimed: the first step after a switch rebuilds the blocks
    begin = time.thread_time()
    for _ in range(steps):
        scheduler.step([])
    return (time.thread_time() - begin) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=250)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    scheduler, model = build(args.model_path, args.requests)
    start(scheduler, args.requests, args.prompt_len, args.rounds * 2 * (args.steps + 1) + 1)
    running = model.language_model.model.layers[0].self_attn.backend.running
    times: dict[str, list[float]] = {name: [] for name in BUDGETS}
    for _ in range(args.rounds):
        for name, budget in BUDGETS.items():
            running.max_bytes = budget
            times[name].append(cpu_ms_per_step(scheduler, args.steps))
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.requests} requests, {args.prompt_len}-token prompts, CPU ms per decode step")
    for name, value in med.items():
        print(f"{name:<12} median {value:7.2f}   min {min(times[name]):7.2f}")
    print(f"kept blocks / gather: {med['kept blocks'] / med['gather']:.3f}")


if __name__ == "__main__":
    main()
