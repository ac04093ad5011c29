"""The sampler's time per decode step at 64 running requests, with no sampling control and with
every control on, next to the forward time of the same step.

    python scripts/bench_sampler.py                       # tiny checkpoint, CPU
    python scripts/bench_sampler.py --model-path DIR --device cuda --vocab 151936

Two measurements, side by side in one run (ratios, never absolute limits):

- engine: the real scheduler on a checkpoint (the tiny one by default) with `--requests`
  requests decoding; per step, the forward (`ModelRunner.decode`) and the sampling
  (`Scheduler.sample`: controls, filters, draws) are timed apart, for the batch without controls
  and for the same batch with every control on, plus logprobs.
- vocabulary: the sampler alone on random logits of `--vocab` columns (a real Qwen vocabulary by
  default, which the tiny checkpoint lacks), with each request's penalty state holding
  `--history` distinct tokens, as a long conversation would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampler import RowControls, Sampler  # noqa: E402
from runtime.sampling_controls import SamplingState  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402


def every_control(i: int) -> dict[str, Any]:
    return {
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "min_tokens": 4,
        "logit_bias": {(7 * i) % 300 + 3: 2.0, 11: -5.0},
        "allowed_token_ids": list(range(3, 400)),
        "bad_words_ids": [[13], [17, 19]],
        "logprobs": 5,
    }


def params(i: int, controls: bool, steps: int) -> SamplingParams:
    extra = every_control(i) if controls else {}
    values = {"temperature": 0.8, "top_p": 0.9, "seed": i, **extra}
    return SamplingParams(max_new_tokens=steps + 8, ignore_eos=True, **values).normalize()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_step_times(sched: Scheduler, device: str) -> tuple[float, float]:
    """(forward seconds, sampling seconds) of one decode step; the step then advances."""
    reqs = list(sched.running)
    sync(device)
    start = time.perf_counter()
    logits = sched.runner.decode(reqs)
    sync(device)
    forward = time.perf_counter() - start
    sched.sample(reqs, logits)
    sync(device)
    sampling = time.perf_counter() - start - forward
    sched.cache.ensure_free(len(reqs))
    sched.sample_and_append(reqs, logits)
    return forward, sampling


def bench_engine(args: argparse.Namespace, model_path: str, controls: bool) -> dict[str, float]:
    server_args = ServerArgs(
        model_path=model_path,
        device=args.device,
        max_running_requests=args.requests,
        max_total_tokens=args.requests * (args.prompt_len + args.steps + 16),
        chunked_prefill_size=args.requests * args.prompt_len,
        max_prefill_tokens=args.requests * args.prompt_len,
    )
    sched = build_scheduler(server_args, TPGroup())
    reqs = [
        TokenizedGenerateReq(
            f"r{i}",
            [(i * 31 + j * 7) % 400 + 3 for j in range(args.prompt_len)],
            params(i, controls, args.steps),
        )
        for i in range(args.requests)
    ]
    sched.step(reqs)
    while len(sched.running) < args.requests:
        sched.step([])
    times = [engine_step_times(sched, args.device) for _ in range(args.steps)]
    forward = statistics.median(t[0] for t in times) * 1e3
    sampling = statistics.median(t[1] for t in times) * 1e3
    return {"forward_ms": forward, "sampler_ms": sampling}


def bench_vocab(args: argparse.Namespace, controls: bool) -> float:
    """Median sampler milliseconds per step on random logits of a full vocabulary."""
    device = args.device
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.requests, args.vocab, generator=gen) * 3).to(device)
    batch = [params(i, controls, args.steps) for i in range(args.requests)]
    if controls:
        for p in batch:
            p.allowed_token_ids = list(range(3, args.vocab, 3))
    history = torch.randint(0, args.vocab, (args.requests, args.history), generator=gen).tolist()
    states = [
        SamplingState.for_request(p, ids, args.history // 2, args.vocab)
        for p, ids in zip(batch, history)
    ]
    rows = RowControls(states, [(2,)] * args.requests)
    steps = [args.history // 2] * args.requests
    sampler = Sampler(seed=0)
    times = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        sampler.sample_safe(logits, batch, steps, rows if controls else None)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the tiny Qwen2-VL checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--history", type=int, default=1024, help="prompt+output tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or str(make_checkpoint("qwen2_vl", Path(tmp) / "tiny"))
        result = {
            "engine_none": bench_engine(args, model_path, controls=False),
            "engine_all": bench_engine(args, model_path, controls=True),
        }
    result["vocab_none_ms"] = bench_vocab(args, controls=False)
    result["vocab_all_ms"] = bench_vocab(args, controls=True)
    none, every = result["engine_none"], result["engine_all"]
    print(f"{args.requests} running requests, {args.device}, median of {args.steps} steps")
    print(
        f"engine: forward {none['forward_ms']:.2f} ms; sampler {none['sampler_ms']:.2f} ms "
        f"without controls, {every['sampler_ms']:.2f} ms with every control "
        f"({every['sampler_ms'] / none['sampler_ms']:.2f}x; "
        f"{every['sampler_ms'] / every['forward_ms']:.2f} of the forward)"
    )
    print(
        f"vocabulary {args.vocab}, {args.history} tokens of history: sampler "
        f"{result['vocab_none_ms']:.2f} ms without controls, {result['vocab_all_ms']:.2f} ms "
        f"with every control ({result['vocab_all_ms'] / result['vocab_none_ms']:.2f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
