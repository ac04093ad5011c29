"""Structured outputs' cost on the real scheduler, side by side in one run on the same workload:
output tokens/s with 0%, 50% and 100% of the requests constrained by a JSON schema (and 50% and
100% with jump-forward off), the mask time per constrained token, the forward steps jump-forward
saved, and the grammar compile time cold and cached.

    python scripts/bench_structured.py                      # tiny checkpoint, CPU, smoke size
    python scripts/bench_structured.py --requests 16 --max-new-tokens 256 --rounds 5

The workload is fair: every configuration sends the same prompts with the same max_tokens, and
every request runs to max_tokens (unconstrained ones ignore EOS; the schema, an array of at
least 2000 objects, cannot end sooner), so each produces the same number of output tokens. The
configurations run in interleaved rounds (the order rotates each round) and the report gives
medians, with the machine's load average, since other work shares the machine; torch runs on
one thread unless --threads says otherwise (on a shared 2-core machine two threads wait at
OpenMP barriers for whatever else runs, which swamps what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the constraints are the tests' data

from grammar_cases import SCHEMAS  # noqa: E402

from runtime.distributed import TPGroup  # noqa: E402
from runtime.grammar import GrammarSpec, checkpoint_compiler  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from vision.vlm import build_model  # noqa: E402

LONG = {  # fixed keys (forced runs for jump-forward) and free values, longer than any run
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 2000,
}
CONFIGS = {  # name -> (share constrained, jump-forward)
    "0%": (0.0, True),
    "50%": (0.5, True),
    "100%": (1.0, True),
    "50% stepwise": (0.5, False),
    "100% stepwise": (1.0, False),
}


def workload(n: int, share: float, max_new: int) -> list[TokenizedGenerateReq]:
    """The same prompts and max_tokens at every share; the first `share` of them constrained."""
    constrained = round(n * share)
    reqs = []
    for i in range(n):
        spec = GrammarSpec.json_schema(LONG) if i < constrained else None
        params = SamplingParams(
            temperature=1.0, seed=i, max_new_tokens=max_new, grammar=spec, ignore_eos=True
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
            mask, faults = inner(reqs, vocab)
            self.seconds += time.perf_counter() - start
            self.rows += 0 if mask is None else int(mask.rows.numel())
            return mask, faults

        scheduler.grammar.mask = timed  # type: ignore[method-assign]


def run(scheduler: Scheduler, reqs: list[TokenizedGenerateReq]) -> dict[str, float]:
    timer = MaskTimer(scheduler)
    counters = scheduler.counters
    before = (counters.generated_tokens, counters.forced_tokens, steps(scheduler))
    start = time.perf_counter()
    scheduler.step(reqs)
    while not scheduler.idle:
        scheduler.step([])
    wall = time.perf_counter() - start
    tokens = counters.generated_tokens - before[0]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "mask_us_per_token": 1e6 * timer.seconds / timer.rows if timer.rows else 0.0,
        "steps": steps(scheduler) - before[2],
        "steps_saved": counters.forced_tokens - before[1],
    }


def steps(scheduler: Scheduler) -> int:
    return scheduler.counters.prefill_steps + scheduler.counters.decode_steps


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
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: other work on the machine "
        "does not stall the step at OpenMP barriers)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(args.model_path or make_checkpoint("qwen2_vl", Path(tempfile.mkdtemp()) / "ck"))
    model = build_model(str(folder), TPGroup(), dtype="float32")
    schedulers = {name: scheduler_for(folder, model, jf) for name, (_, jf) in CONFIGS.items()}
    for name, scheduler in schedulers.items():
        run(scheduler, workload(2, CONFIGS[name][0], 4))  # warm-up: compiles and first steps
    load = [os.getloadavg()[0]]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            reqs = workload(args.requests, CONFIGS[name][0], args.max_new_tokens)
            rounds[name].append(run(schedulers[name], reqs))
    load.append(os.getloadavg()[0])
    results: dict[str, Any] = {name: medians(rows) for name, rows in rounds.items()}
    base = results["0%"]["tokens_per_s"]
    for name in CONFIGS:
        results[name]["vs_unconstrained"] = results[name]["tokens_per_s"] / base
    cfg = schedulers["0%"].cfg
    results["compile"] = compile_times(folder, cfg.vocab_size, list(cfg.eos_token_ids))
    results["jump_forward_steps_saved"] = results["100%"]["steps_saved"]
    results["load_average_1m"] = load
    results["torch_threads"] = args.threads
    print(json.dumps(results, indent=1))
    return results


def scheduler_for(folder: Path, model: Any, jump_forward: bool) -> Scheduler:
    server = ServerArgs(
        model_path=str(folder),
        device="cpu",
        max_total_tokens=20000,
        disable_jump_forward=not jump_forward,
    )
    return build_scheduler(server, TPGroup(), model)


def medians(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Each measure's median over the rounds, and each round's tokens/s."""
    summary: dict[str, Any] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    summary["tokens_per_s_rounds"] = [round(row["tokens_per_s"], 1) for row in rows]
    return summary


if __name__ == "__main__":
    main()
