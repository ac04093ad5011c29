"""Scheduler overhead per step: wall time of Scheduler.step minus time inside the model.

    python scripts/bench_scheduler_overhead.py --requests 64 --steps 50

Runs one rank in-process on the tiny checkpoint (or --model-path) with N text requests decoding
together, and reports per-step total, model and scheduler-only time (median and p90).
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

from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampler import Sampler, SamplingParams  # noqa: E402
from scheduler.encoder_cache import EncoderCache  # noqa: E402
from scheduler.model_runner import ModelRunner  # noqa: E402
from scheduler.radix_cache import RadixCache  # noqa: E402
from scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from vision.qwen2_vl import build_model  # noqa: E402


class TimedRunner:
    """Forwards to the real runner and adds up the time spent in the model."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.model_s = runner, 0.0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.model_s += time.perf_counter() - start
        return out

    def extend(self, *args):
        return self._timed(self.runner.extend, *args)

    def decode(self, *args):
        return self._timed(self.runner.decode, *args)


def build(model_path: str, n: int) -> tuple[Scheduler, TimedRunner]:
    model = build_model(model_path, TPGroup(), dtype="float32")
    runner = TimedRunner(
        ModelRunner(
            model, max_total_tokens=64 * 1024, max_running_requests=n + 1, max_context_len=4096
        )
    )
    cfg = SchedulerConfig(
        max_running_requests=n,
        max_prefill_tokens=16384,
        chunked_prefill_size=4096,
        context_length=4096,
    )
    radix = RadixCache(runner.kv_pool)
    return Scheduler(cfg, TPGroup(), runner, radix, EncoderCache(0), Sampler()), runner


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path is None:
            from make_tiny_checkpoint import make_checkpoint

            args.model_path = str(make_checkpoint("qwen2_vl", Path(tmp) / "tiny"))
        scheduler, runner = build(args.model_path, args.requests)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.steps + 5, ignore_eos=True)
        msgs = [
            TokenizedGenerateReq(f"r{i}", [1 + (i * 7 + j) % 300 for j in range(32)], params)
            for i in range(args.requests)
        ]
        scheduler.step(msgs)
        while scheduler.waiting or scheduler.chunked:
            scheduler.step([])
        totals, models = [], []
        for _ in range(args.steps):
            runner.model_s = 0.0
            start = time.perf_counter()
            scheduler.step([])
            totals.append(time.perf_counter() - start)
            models.append(runner.model_s)
    overhead = [t - m for t, m in zip(totals, models)]
    print(f"{len(scheduler.running)} running requests, {args.steps} decode steps (CPU, 1 thread)")
    for name, values in (("step total", totals), ("model", models), ("scheduler", overhead)):
        ms = sorted(v * 1e3 for v in values)
        p90 = ms[int(0.9 * (len(ms) - 1))]
        print(f"{name:<11} median {statistics.median(ms):8.3f} ms   p90 {p90:8.3f} ms")


if __name__ == "__main__":
    main()
