"""Structured outputs' cost on the real scheduler, side by side in one run on the same workload:
output tokens/s with 0%, 50% and 100% of the requests constrained by a JSON schema, the mask time
per constrained token, and the grammar compile time cold and cached.

    python scripts/bench_structured.py                      # tiny checkpoint, CPU, smoke size
    python scripts/bench_structured.py --requests 32 --max-new-tokens 128

Constrained requests end when their schema does (at EOS), unconstrained ones (ignore_eos) run to
--max-new-tokens, so throughput is output tokens per second of wall time over the whole workload.
Jump-forward is not built yet, so no forward steps are saved (reported as 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from grammar_cases import SCHEMAS  # noqa: E402

from runtime.distributed import TPGroup  # noqa: E402
from runtime.grammar import GrammarSpec, checkpoint_compiler  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampler import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from vision.vlm import build_model  # noqa: E402

BOUNDED = (0, 3, 6, 9, 10)  # schemas a noise model ends quickly


def workload(n: int, share: float, max_new: int) -> list[TokenizedGenerateReq]:
    constrained = round(n * share)
    reqs = []
    for i in range(n):
        spec = (
            GrammarSpec.json_schema(SCHEMAS[BOUNDED[i % len(BOUNDED)]]) if i < constrained else None
        )
        params = SamplingParams(
            temperature=1.0, seed=i, max_new_tokens=max_new, grammar=spec, ignore_eos=spec is None
        )
        prompt = [(i * 37 + j * 11) % 300 + 20 for j in range(32)]
        reqs.append(TokenizedGenerateReq(f"r{i}", prompt, params))
    return reqs


class MaskTimer:
    """Wraps the scheduler's mask hook: seconds spent and constrained rows masked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.seconds, self.rows = 0.0, 0
        inner = scheduler.grammar.mask

        def timed(reqs: Any, vocab: int) -> Any:
            start = time.perf_counter()
            mask = inner(reqs, vocab)
            self.seconds += time.perf_counter() - start
            self.rows += 0 if mask is None else int(mask.rows.numel())
            return mask

        scheduler.grammar.mask = timed  # type: ignore[method-assign]


def run(scheduler: Scheduler, reqs: list[TokenizedGenerateReq]) -> dict[str, float]:
    timer = MaskTimer(scheduler)
    before = scheduler.counters.generated_tokens
    start = time.perf_counter()
    scheduler.step(reqs)
    while not scheduler.idle:
        scheduler.step([])
    wall = time.perf_counter() - start
    tokens = scheduler.counters.generated_tokens - before
    mask_us = 1e6 * timer.seconds / timer.rows if timer.rows else 0.0
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "mask_us_per_token": mask_us}


def compile_times(folder: Path, vocab: int, eos: list[int]) -> dict[str, float]:
    compiler = checkpoint_compiler(str(folder), vocab, eos)
    spec = GrammarSpec.json_schema(SCHEMAS[1])
    start = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(spec)
    cached = time.perf_counter() - start
    compiler.close()
    return {"compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: a tiny random checkpoint")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    folder = Path(args.model_path or make_checkpoint("qwen2_vl", Path(tempfile.mkdtemp()) / "ck"))
    model = build_model(str(folder), TPGroup(), dtype="float32")
    server = ServerArgs(model_path=str(folder), device="cpu", max_total_tokens=20000)
    results: dict[str, Any] = {}
    for share in (0.0, 0.5, 1.0):
        scheduler = build_scheduler(server, TPGroup(), model)
        run(scheduler, workload(2, share, 4))  # warm-up: compiles and first steps
        results[f"{int(share * 100)}%"] = run(
            scheduler, workload(args.requests, share, args.max_new_tokens)
        )
    base = results["0%"]["tokens_per_s"]
    for row in results.values():
        row["vs_unconstrained"] = row["tokens_per_s"] / base
    cfg = build_scheduler(server, TPGroup(), model).cfg
    results["compile"] = compile_times(folder, cfg.vocab_size, list(cfg.eos_token_ids))
    results["jump_forward_steps_saved"] = 0
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
