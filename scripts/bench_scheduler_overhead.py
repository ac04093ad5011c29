"""Scheduler overhead per step: wall time of Scheduler.step minus time inside the model.

    python scripts/bench_scheduler_overhead.py --requests 64 --steps 50 [--threads 2]

Runs one rank in-process on the tiny checkpoint (or --model-path) with N text requests decoding
together, and reports per-step total, model and scheduler-only time (median and p90).

With --instant-model the model answers each decode step at once (zero logits) and the report is
each step's CPU time on this thread: the scheduler's own work (sampling, bookkeeping, the
runner's batch building), without the model's time and without the time a loaded machine
takes the CPU away, which the wall-clock figures include.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from runtime.allocator import keep_freed_memory  # noqa: E402
from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from vision.vlm import build_model  # noqa: E402


class TimedModel:
    """Forwards to the real model and adds up the time spent in its forward calls."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.model_s = model, 0.0
        self.instant = False  # answer with zero logits, without running the model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args):
        if self.instant:
            rows = args[0].last_token_indices.numel()
            return torch.zeros(rows, self.model.config.text.vocab_size)
        start = time.perf_counter()
        out = self.model(*args)
        self.model_s += time.perf_counter() - start
        return out


def build(model_path: str, n: int, cpu_linear: str = "onednn") -> tuple[Scheduler, TimedModel]:
    """The server's own factory, with a timed model."""
    args = ServerArgs(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        max_total_tokens=64 * 1024,
        max_running_requests=n,
        max_prefill_tokens=16384,
        chunked_prefill_size=4096,
        context_length=4096,
    )
    model = TimedModel(build_model(model_path, TPGroup(), dtype="float32", cpu_linear=cpu_linear))
    return build_scheduler(args, TPGroup(), model), model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--instant-model", action="store_true", help="CPU time per step, no model")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the rank")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every server process does: freed buffers are not faulted in again
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path is None:
            from runtime.tiny_checkpoint import make_checkpoint

            args.model_path = str(make_checkpoint("qwen2_vl", Path(tmp) / "tiny"))
        scheduler, model = build(args.model_path, args.requests)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.steps + 5, ignore_eos=True)
        prompts = [
            [1 + (i * 7 + j) % 300 for j in range(args.prompt_len)] for i in range(args.requests)
        ]
        msgs = [TokenizedGenerateReq(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
        scheduler.step(msgs)
        while scheduler.waiting or scheduler.chunked:
            scheduler.step([])
        model.instant = args.instant_model
        clock = time.thread_time if args.instant_model else time.perf_counter
        totals, models, cpu = [], [], []
        for _ in range(args.steps):
            model.model_s = 0.0
            start, start_cpu = clock(), time.process_time()
            scheduler.step([])
            totals.append(clock() - start)
            cpu.append(time.process_time() - start_cpu)
            models.append(model.model_s)
    threads = f"{args.threads} thread{'s' * (args.threads > 1)}"
    print(f"{len(scheduler.running)} running requests, {args.steps} decode steps (CPU, {threads})")
    if args.instant_model:
        report("scheduler CPU (instant model)", totals)
        return
    report("step CPU", cpu)  # every thread of the process: what the step takes from others
    overhead = [t - m for t, m in zip(totals, models)]
    for name, values in (("step total", totals), ("model", models), ("scheduler", overhead)):
        report(name, values)


def report(name: str, seconds: list[float]) -> None:
    ms = sorted(v * 1e3 for v in seconds)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    print(f"{name:<11} median {statistics.median(ms):8.3f} ms   p90 {p90:8.3f} ms")


if __name__ == "__main__":
    main()
