"""Time to first token of long prompts that arrive together, in one scheduler (no server).

    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --preset hd64 --out /tmp/hd64
    python scripts/bench_long_prompts.py --model-path /tmp/hd64 --prompts 2 --prompt-len 3400

Builds rank 0's scheduler with the server's own factory (CPU, float32, the server's default
chunk size and prefill budget unless given), submits `--prompts` distinct prompts of
`--prompt-len` tokens in one step, and steps until every one has its first token. Prints, per
round, each request's seconds to its first token (in arrival order) and the steps taken; the
first round warms up and is not counted. How the prefill budget is shared between prompts that
are cut into chunks decides who waits for whom.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.allocator import keep_freed_memory  # noqa: E402
from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from vision.vlm import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=3400)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    return p.parse_args(argv)


def first_tokens(scheduler, prompts: list[list[int]], tag: str) -> tuple[list[float], int]:
    """Seconds from submission to each request's first token (arrival order), and steps."""
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    msgs = [TokenizedGenerateReq(f"{tag}-{i}", ids, params) for i, ids in enumerate(prompts)]
    start, seen, steps = time.perf_counter(), {}, 0
    incoming = msgs
    while len(seen) < len(msgs):
        result = scheduler.step(incoming)
        incoming, steps = [], steps + 1
        now = time.perf_counter()
        for out in result.outputs:
            seen.setdefault(out.rid, now - start)
    while not scheduler.idle:
        scheduler.step([])
    return [seen[m.rid] for m in msgs], steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every server process does
    extra = {
        k: v
        for k, v in (("chunked_prefill_size", args.chunked_prefill_size),
                     ("max_prefill_tokens", args.max_prefill_tokens))
        if v is not None
    }
    server = ServerArgs(model_path=args.model_path, device="cpu", dtype="float32",
                        max_total_tokens=(args.prompts + 1) * args.prompt_len + 4096,
                        context_length=args.prompt_len + 64, **extra)
    model = build_model(args.model_path, TPGroup(), dtype="float32")
    scheduler = build_scheduler(server, TPGroup(), model)
    print(f"{args.prompts} prompts of {args.prompt_len} tokens at once; chunk "
          f"{server.chunked_prefill_size}, prefill budget {server.max_prefill_tokens}")
    rows = []
    for r in range(args.rounds + 1):
        prompts = [[1 + (i * 7 + j * 13 + r * 31) % 500 for j in range(args.prompt_len)]
                   for i in range(args.prompts)]
        times, steps = first_tokens(scheduler, prompts, f"r{r}")
        if r:
            rows.append(times)
            print(f"round {r}: first tokens at {', '.join(f'{t:.3f}' for t in times)} s "
                  f"({steps} steps)")
    means = [statistics.mean(t) for t in rows]
    firsts = [t[0] for t in rows]
    print(f"median over rounds: first request {statistics.median(firsts):.3f} s, "
          f"mean of all {statistics.median(means):.3f} s")


if __name__ == "__main__":
    main()
