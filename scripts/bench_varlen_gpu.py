"""The vision towers' segment attention on a GPU: the Triton kernel at several tile sizes against
the torch path (equal-length segments batched into scaled_dot_product_attention), at the shapes
of Qwen2.5-VL-7B's tower on a batch of 448x448 images.

    python scripts/bench_varlen_gpu.py --images 32 --json varlen.json

Shapes: 1024 patches per image, 16 heads of 80; windowed blocks attend inside 64-patch windows
(112 px), full blocks over each image's 1024 patches. Each variant's output is checked against
the torch path (bfloat16 rounding) and timed with CUDA events; the report gives milliseconds
and the attention's TFLOP/s (4 * length^2 * width per segment).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from kernels.attention.varlen import Segments, varlen_attention  # noqa: E402

TILES = ((32, 32), (64, 32), (64, 64), (128, 64))


def timed_ms(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_varlen_gpu: needs a CUDA device")
    from kernels.triton.varlen_attention import varlen_attention as triton_varlen

    heads, head_dim, patches = 16, 80, 1024
    tokens = args.images * patches
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = torch.randn(3, tokens, heads, head_dim, device="cuda", generator=gen,
                          dtype=torch.bfloat16).unbind(0)
    results = {"device": torch.cuda.get_device_name(), "tokens": tokens, "rows": []}
    for kind, length in (("window", 64), ("full", patches)):
        cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
        segments = Segments.build(cu, "cuda")
        flops = 4.0 * head_dim * heads * length * length * (tokens // length)
        ref = varlen_attention(q, k, v, segments, head_dim**-0.5)
        variants = {"torch sdpa": lambda s=segments: varlen_attention(q, k, v, s, head_dim**-0.5)}
        for bm, bn in TILES:
            variants[f"triton {bm}x{bn}"] = (
                lambda s=segments, bm=bm, bn=bn: triton_varlen(q, k, v, s, head_dim**-0.5, bm, bn)
            )
        for name, fn in variants.items():
            try:
                err = float((fn().float() - ref.float()).abs().max())
                ms = timed_ms(fn, args.repeat)
                row = {"segments": kind, "variant": name, "ms": round(ms, 3),
                       "tflop_s": round(flops / ms / 1e9, 1), "max_abs_err": err}
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a row
                row = {"segments": kind, "variant": name, "error": repr(exc)[:200]}
            results["rows"].append(row)
            print(row, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
