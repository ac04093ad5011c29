"""Mixed prefill+decode steps on and off, in-process, timed on the thread's CPU clock.

    python scripts/bench_mixed_steps.py --rounds 3 --arrivals-per-step 4

The decode-heavy workload of issue 12 without HTTP: the real scheduler (one rank, one thread) on a
generated tiny Qwen2-VL checkpoint, 32 image requests (448x448 and 224x336 alternating), 32 output
tokens each, 16 clients in a closed loop; at most --arrivals-per-step new requests reach the
scheduler per step (the front end staggers them). Latencies are read on `time.thread_time`, so
other processes on a shared machine do not count. Prints, per run: CPU seconds, requests per CPU
second, ITL p50/p99 and mean TTFT in ms, and the step counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_offline  # noqa: E402

from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402

REQUESTS, CLIENTS, OUTPUT_LEN = 32, 16, 32
SIZES = [(448, 448), (224, 336)]


def make_requests(folder: str, tmp: str) -> tuple[ServerArgs, list[TokenizedGenerateReq]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=OUTPUT_LEN, ignore_eos=True)
    per_size = []
    for seed, size in enumerate(SIZES):
        ns = argparse.Namespace(
            seed=seed, image_size=size, device="cpu", dtype="float32",
            attention_backend="torch", batch_sizes=[CLIENTS], max_total_tokens=None,
        )  # fmt: skip
        args = bench_offline.server_args(ns, folder, tmp)
        per_size.append(bench_offline.make_prompts(ns, args, REQUESTS // 2, params))
    mixed = [p.ours for pair in zip(*per_size) for p in pair]
    return args, [dataclasses.replace(r, rid=f"q{i}") for i, r in enumerate(mixed)]


def run(scheduler: Scheduler, requests: list[TokenizedGenerateReq], per_step: int) -> dict:
    queue, inflight, arrived, last = list(requests), 0, {}, {}
    itl, ttft, start = [], [], time.thread_time()
    while queue or inflight:
        new = []
        while queue and inflight < CLIENTS and len(new) < per_step:
            new.append(queue.pop(0))
            arrived[new[-1].rid], inflight = time.thread_time(), inflight + 1
        result, now = scheduler.step(new), time.thread_time()
        for out in result.outputs:
            if out.new_token_ids:
                gaps = itl if out.rid in last else ttft
                gaps.append(now - last.get(out.rid, arrived[out.rid]))
                last[out.rid] = now
            inflight -= out.finish_reason is not None
    return summary(time.thread_time() - start, itl, ttft, scheduler)


def summary(cpu: float, itl: list[float], ttft: list[float], scheduler: Scheduler) -> dict:
    c = scheduler.counters
    return {
        "cpu_s": round(cpu, 2),
        "req_per_cpu_s": round(REQUESTS / cpu, 2),
        "itl_p50_ms": round(1000 * float(np.percentile(itl, 50)), 1),
        "itl_p99_ms": round(1000 * float(np.percentile(itl, 99)), 1),
        "ttft_mean_ms": round(1000 * float(np.mean(ttft)), 1),
        "steps": {"prefill": c.prefill_steps, "decode": c.decode_steps, "mixed": c.mixed_steps},
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arrivals-per-step", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="tessera-mixed-")
    folder = str(make_checkpoint("qwen2_vl", Path(tmp) / "ckpt"))
    base, requests = make_requests(folder, tmp)
    base = dataclasses.replace(base, chunked_prefill_size=2048, max_prefill_tokens=8192)
    rows = []
    for _ in range(args.rounds):
        for mixed in (False, True):
            args_mixed = dataclasses.replace(base, enable_mixed_chunk=mixed)
            scheduler = build_scheduler(args_mixed, TPGroup())
            rows.append({"mixed": mixed, **run(scheduler, requests, args.arrivals_per_step)})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
