"""Benchmark the vision encoder in TP mode against DP mode on the same batch of images.

    python scripts/bench_vit_dp_vs_tp.py --tp 2 --random-images 8 --seed 0 --warmup 2 --repeat 5

Spawns --tp ranks (Gloo on CPU, NCCL on CUDA). Every rank builds the tower twice: sharded over
the group (TP mode: per-layer all-reduce) and as a full replica (DP mode: greedy balance by patch
count, one all-gather). Both run the same pixel batch; the table reports, per mode, the median and
p90 time per batch, images/s, patches processed per rank, imbalance (max/mean) and the payload
bytes one rank hands to collectives per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.ops import get_kernel_ops  # noqa: E402
from runtime.distributed import TPGroup, destroy_tp_group, init_tp_group  # noqa: E402
from runtime.model_config import ModelConfig  # noqa: E402
from runtime.model_loader import iterate_weights  # noqa: E402
from tokenizer_manager.video_processor import smart_resize  # noqa: E402
from vision.dp_encoder import get_dp_encoder_lb_assignment, run_dp_sharded_mrope_vision_model  # noqa: E402
from vision.qwen2_vl import VISION_TOWERS, normalize_checkpoint_name  # noqa: E402


class CountingGroup(TPGroup):
    """A TPGroup that adds up the bytes each collective is handed on this rank."""

    def __init__(self, base: TPGroup):
        super().__init__(base.rank, base.size, base.device_group, base.cpu_group)
        object.__setattr__(self, "counter", [0])

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counter[0] += tensor.numel() * tensor.element_size() if self.size > 1 else 0
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        out = super().all_gather(tensor, dim)
        self.counter[0] += out.numel() * out.element_size() if self.size > 1 else 0
        return out


@dataclass
class ModeResult:
    mode: str
    median_ms: float
    p90_ms: float
    images_per_s: float
    patches_per_rank: list[int]
    imbalance: float
    collective_bytes_per_rank: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: a tiny one)")
    p.add_argument("--arch", default="qwen2_vl", help="tiny checkpoint arch without --model-path")
    p.add_argument("--image-sizes", default=None, help="e.g. 448x448,224x336 (HxW pixels)")
    p.add_argument("--random-images", type=int, default=8)
    p.add_argument("--min-size", type=int, default=112)
    p.add_argument("--max-size", type=int, default=448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="vision attention (auto: triton on CUDA, torch on CPU)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart here (needs matplotlib)")
    return p.parse_args(argv)


def image_sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.image_sizes:
        return [tuple(int(x) for x in s.split("x")) for s in args.image_sizes.split(",")]
    rng = random.Random(args.seed)
    return [
        (rng.randint(args.min_size, args.max_size), rng.randint(args.min_size, args.max_size))
        for _ in range(args.random_images)
    ]


def make_batch(cfg: ModelConfig, sizes: list[tuple[int, int]], seed: int):
    v = cfg.vision
    factor = v.patch_size * v.spatial_merge_size
    grids = []
    for h, w in sizes:
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=factor**2, max_pixels=16384 * 28 * 28)
        grids.append([1, rh // v.patch_size, rw // v.patch_size])
    total = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, v.patch_dim, generator=gen), grids


def build_tower(
    cfg: ModelConfig, model_path: str, tp: TPGroup, device: str, dtype: torch.dtype, backend: str
):
    with torch.device(device):
        tower = VISION_TOWERS[cfg.arch](cfg.vision, tp, get_kernel_ops(backend)).to(dtype)
    weights = []
    for name, w in iterate_weights(model_path):
        name = normalize_checkpoint_name(name)
        if name.startswith("visual."):
            weights.append((name[len("visual.") :], w))
    tower.load_weights(weights)
    return tower.eval()


def time_mode(fn, tp: TPGroup, warmup: int, repeat: int, device: str) -> list[float]:
    times = []
    for i in range(warmup + repeat):
        if tp.size > 1:
            torch.distributed.barrier(group=tp.cpu_group)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def summarize(mode: str, times: list[float], n_images: int, loads: list[int], nbytes: int):
    times_ms = sorted(t * 1e3 for t in times)
    p90 = times_ms[min(len(times_ms) - 1, int(round(0.9 * (len(times_ms) - 1))))]
    median = statistics.median(times_ms)
    mean_load = sum(loads) / len(loads)
    return ModeResult(
        mode,
        median,
        p90,
        n_images / (median / 1e3),
        loads,
        max(loads) / mean_load if mean_load else 1.0,
        nbytes,
    )


def rank_main(rank: int, args: argparse.Namespace, model_path: str, port: int, queue) -> None:
    device = "cuda" if args.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    base = init_tp_group(rank, args.tp, f"tcp://127.0.0.1:{port}", use_cuda=device == "cuda")
    try:
        queue.put((rank, run_rank(args, model_path, base, device)))
    finally:
        destroy_tp_group()


def run_rank(args: argparse.Namespace, model_path: str, base: TPGroup, device: str) -> list:
    cfg = ModelConfig.from_dir(model_path)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    pixels, grids = make_batch(cfg, image_sizes(args), args.seed)
    pixels = pixels.to(device=device, dtype=dtype)
    grid_t = torch.tensor(grids, dtype=torch.long)
    sizes = [t * h * w for t, h, w in grids]
    results = []
    with torch.inference_mode():
        tp_group = CountingGroup(base)
        tower = build_tower(cfg, model_path, tp_group, device, dtype, args.attention_backend)
        times = time_mode(lambda: tower(pixels, grid_t), base, args.warmup, args.repeat, device)
        per_batch = tp_group.counter[0] // (args.warmup + args.repeat)
        results.append(summarize("tp", times, len(grids), [sum(sizes)] * base.size, per_batch))
        del tower
        dp_group = CountingGroup(base)
        tower = build_tower(cfg, model_path, TPGroup(), device, dtype, args.attention_backend)
        merge = cfg.vision.spatial_merge_size

        def run_dp() -> torch.Tensor:
            return run_dp_sharded_mrope_vision_model(
                tower, pixels, grids, dp_group, spatial_merge_size=merge
            )

        times = time_mode(run_dp, base, args.warmup, args.repeat, device)
        per_batch = dp_group.counter[0] // (args.warmup + args.repeat)
        _, _, loads = get_dp_encoder_lb_assignment(sizes, base.size)
        results.append(summarize("dp", times, len(grids), loads, per_batch))
    return [asdict(r) for r in results]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: argparse.Namespace, model_path: str) -> list[dict]:
    """Run every rank; returns rank 0's results. Children are always reaped."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args, model_path, port, queue), daemon=True)
        for r in range(args.tp)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=1800) for _ in procs)
        return results[0]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def print_table(results: list[dict], args: argparse.Namespace, n_images: int) -> None:
    print(f"ViT benchmark: tp={args.tp}, {n_images} images, device={args.device}")
    head = f"{'mode':<5}{'median ms':>11}{'p90 ms':>9}{'img/s':>9}{'imbalance':>11}"
    print(head + f"{'coll. MB/rank':>15}  patches per rank")
    for r in results:
        print(
            f"{r['mode']:<5}{r['median_ms']:>11.2f}{r['p90_ms']:>9.2f}{r['images_per_s']:>9.1f}"
            f"{r['imbalance']:>11.2f}{r['collective_bytes_per_rank'] / 1e6:>15.2f}  "
            f"{r['patches_per_rank']}"
        )
    tp, dp = results
    print(f"DP speed-up over TP (median): {tp['median_ms'] / dp['median_ms']:.2f}x")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar([r["mode"] for r in results], [r["median_ms"] for r in results])
    ax.set_ylabel("median ms per batch")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= args.tp else "cpu"
    if args.attention_backend == "auto":
        args.attention_backend = "triton" if args.device == "cuda" else "torch"
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or tiny_checkpoint(args.arch, tmp)
        results = spawn(args, model_path)
    print_table(results, args, len(image_sizes(args)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if args.plot:
        plot(results, args.plot)


def tiny_checkpoint(arch: str, tmp: str) -> str:
    from make_tiny_checkpoint import make_checkpoint

    return str(make_checkpoint(arch, Path(tmp) / arch))


if __name__ == "__main__":
    main()
