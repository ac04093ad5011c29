"""CPU linear layers per shape: aten's linear (MKL) against oneDNN with a prepacked weight.

    python scripts/bench_linear.py --threads 1 2
    python scripts/bench_linear.py --threads 1 --env MKL_ENABLE_INSTRUCTIONS=AVX2

Shapes are the decoder's and the vision tower's linear layers of the `hd64` and `100m` presets
(runtime/tiny_checkpoint.py), at decode (1, 4, 16 rows) and prefill (256 to 4096 rows) sizes.
Paths: `mkl` (F.linear, what aten runs), `onednn` (`mkldnn._linear_pointwise` over a weight
reordered once by `mkldnn._reorder_linear_weight`), `mkl-packed` (`mkl._mkl_linear` over a weight
packed once by `mkl._mkl_reorder_linear_weight`, what Inductor's freezing uses for float32).
The paths run interleaved, round by round; each cell is the median over rounds of the time per
call (this thread's CPU time with one thread; wall time with more, where the CPU time of the
other threads would be missed). `--env` reruns the whole table in a child process with those
variables set (MKL reads them at start-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (preset, layer, out_features, in_features)
SHAPES = [
    ("hd64", "qkv", 768, 512),
    ("hd64", "o", 512, 512),
    ("hd64", "gate_up", 3072, 512),
    ("hd64", "down", 512, 1536),
    ("100m", "qkv", 1024, 768),
    ("100m", "o", 768, 768),
    ("100m", "gate_up", 4096, 768),
    ("100m", "down", 768, 2048),
    ("hd64 vit", "patch", 256, 1176),
    ("hd64 vit", "qkv", 768, 256),
    ("hd64 vit", "fc1", 1024, 256),
    ("hd64 vit", "fc2", 256, 1024),
    ("hd64 vit", "merger.0", 1024, 1024),
    ("100m vit", "patch", 512, 1176),
    ("100m vit", "qkv", 1536, 512),
    ("100m vit", "fc1", 2048, 512),
    ("100m vit", "fc2", 512, 2048),
    ("100m vit", "merger.0", 2048, 2048),
    ("100m vit", "merger.2", 768, 2048),
]
DECODE_ROWS = (1, 4, 16)
PREFILL_ROWS = (256, 1024, 4096)
VIT_ROWS = (256, 1024, 4096)

Call = Callable[[torch.Tensor], torch.Tensor]


def paths(out_f: int, in_f: int, rows: int) -> dict[str, Call]:
    w, b = torch.randn(out_f, in_f), torch.randn(out_f)
    dnn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    out: dict[str, Call] = {
        "mkl": lambda x: F.linear(x, w, b),
        "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, dnn, b, "none", [], ""),
    }
    if torch._C.has_mkl:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        out["mkl-packed"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
    return out


def time_call(fn: Call, x: torch.Tensor, calls: int, threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    begin = clock()
    for _ in range(calls):
        fn(x)
    return (clock() - begin) / calls * 1e3


def measure(out_f: int, in_f: int, rows: int, rounds: int, threads: int) -> dict[str, float]:
    fns = paths(out_f, in_f, rows)
    x = torch.randn(rows, in_f)
    calls = max(2, int(2e8 / (rows * out_f * in_f)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(x)
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            times[name].append(time_call(fns[name], x, calls, threads))
    return {name: statistics.median(t) for name, t in times.items()}


def table(threads: int, rounds: int, only_rows: list[int] | None) -> None:
    torch.set_num_threads(threads)
    print(f"\nthreads {threads}, {rounds} rounds; ms per call (median), ratios against mkl\n")
    print("| preset | layer | N x K | rows | mkl ms | onednn ms | mkl-packed ms | onednn / mkl "
          "| mkl-packed / mkl |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset, layer, out_f, in_f in SHAPES:
        rows_list = VIT_ROWS if "vit" in preset else DECODE_ROWS + PREFILL_ROWS
        for rows in rows_list:
            if only_rows and rows not in only_rows:
                continue
            t = measure(out_f, in_f, rows, rounds, threads)
            packed = t.get("mkl-packed", float("nan"))
            print(f"| {preset} | {layer} | {out_f}x{in_f} | {rows} | {t['mkl']:.3f} "
                  f"| {t['onednn']:.3f} | {packed:.3f} | {t['onednn'] / t['mkl']:.2f} "
                  f"| {packed / t['mkl']:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rows", type=int, nargs="*", help="only these row counts")
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE, rerun in a child process")
    args = p.parse_args(argv)
    if args.env:
        env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
        cmd = [sys.executable, __file__, "--rounds", str(args.rounds)]
        cmd += ["--threads", *map(str, args.threads), "--rows", *map(str, args.rows or [])]
        subprocess.run(cmd, env=env, check=True)
        return
    print(f"torch {torch.__version__}, mkldnn available: {torch.backends.mkldnn.is_available()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    for threads in args.threads:
        table(threads, args.rounds, args.rows)


if __name__ == "__main__":
    main()
