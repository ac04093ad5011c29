"""Benchmark the vision encoder in TP, DP and auto mode on the same batches.

    python scripts/bench_vit_dp_vs_tp.py --tp 2 --workload all --warmup 2 --repeat 5 \
        --json vit.json --plot vit.png
    python scripts/bench_vit_dp_vs_tp.py --served --tp 2 --model-path /tmp/vit-hd64 --rounds 2

(--served: each mode on a fresh server, one client's stream; see scripts/vit_served.py.)

Spawns --tp ranks (Gloo on CPU, NCCL on CUDA). Every rank builds the tower twice: sharded over
the group (TP mode: per-layer all-reduce) and as a full replica, which runs DP mode (greedy
balance by patch count, one all-gather) and auto mode (a plan per call: DP, TP on slices of the
full weights, or a hybrid, from a cost model calibrated here at start-up or given with
--encoder-costs, then learned from its calls). Workloads are lists of batches: `random`
(--random-images / --image-sizes), `one-large`, `many-small`, `one-large-many-small`, `video`,
and `mixed` (the four named shapes one after another, as a server sees them). Each item is
what the checkpoint family's processor makes of an image of that size (ProcessorSpec, as the
server reads the checkpoint): a resize rule's patch grid (pixel bounds wide open, so an 896x896
image keeps its size), or a tiling family's tiles (its tile grid and thumbnail, or its fixed
size and, with --max-tiles above 1, its pan-and-scan crops); a family without videos runs no
`video` workload and a `mixed` without the video batch. A rank that fails stops the run at
once with its error, every rank ended. Modes are timed
interleaved, each round in a rotated order (tp dp auto, dp auto tp, auto tp dp, ...), so load
on a shared machine hits them alike. One AutoEncoder serves every workload in turn, as in a
server. The table reports, per workload and mode, the median and p90 time per batch, items/s,
patches per rank, imbalance (max/mean), the payload bytes one rank hands to collectives per
batch, and for auto the plans taken, in total and per round (warm-up rounds included: auto
learns from every call). --plot draws the medians, auto's plan per call (explorations marked)
and its learned ratios of measured over modeled time per kind of plan across the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import Empty

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.ops import get_kernel_ops  # noqa: E402
from runtime.allocator import keep_freed_memory  # noqa: E402
from runtime.cpus import rank_cpus, threads_per_rank  # noqa: E402
from runtime.distributed import TPGroup, destroy_tp_group, init_tp_group  # noqa: E402
from runtime.families import family_for  # noqa: E402
from runtime.model_config import ModelConfig  # noqa: E402
from runtime.model_loader import iterate_weights  # noqa: E402
from runtime.multimodal import Modality  # noqa: E402
from tokenizer_manager.media.limits import MediaLimits  # noqa: E402
from tokenizer_manager.media.types import ProcessorSpec  # noqa: E402
from vision.auto_encoder import AutoEncoder  # noqa: E402
from vision.dp_encoder import (  # noqa: E402
    frame_units,
    get_dp_encoder_lb_assignment,
    run_dp_over_frames,
)
from vision.encoder_calibration import calibrate_encoder_costs  # noqa: E402
from vision.encoder_learner import Choice, EncoderLearner  # noqa: E402
from vision.encoder_plan import EncoderCosts, TowerShape  # noqa: E402
from vision.vlm import vision_tower_class  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import bench_vit_serving  # noqa: E402


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


@dataclass(frozen=True)
class CallRecord:
    """One auto call: the plan's kind, whether it explored, and each kind's learned ratio
    (median over every size class) when it was planned."""

    kind: str
    explored: bool
    ratios: dict[str, float]


class CallLog(list):
    """Auto's calls in order, as `CallRecord`s: the observer the benchmark's AutoEncoder calls."""

    def __call__(self, choice: Choice, learner: EncoderLearner) -> None:
        self.append(CallRecord(choice.plan.kind, choice.explored, learner.ratios()))


MODES = ("tp", "dp", "auto")
LARGE, SMALL = (1, 896, 896), (1, 224, 224)  # (frames, height, width) in pixels
NAMED = {
    "one-large": [[LARGE]],
    "many-small": [[SMALL] * 16],
    "one-large-many-small": [[LARGE] + [SMALL] * 12],
    "video": [[(16, 336, 336)]],
}
WORKLOADS = ("random", *NAMED, "mixed")


@dataclass
class ModeResult:
    workload: str
    mode: str
    median_ms: float
    p90_ms: float
    items_per_s: float
    patches_per_rank: list[int]
    imbalance: float
    collective_bytes_per_rank: int
    plans: dict[str, int]
    plans_per_round: list[dict[str, int]]  # auto only: its plans in each round, warm-up first
    round_ms: list[float]  # each timed round's time per batch, in order (after the warm-up)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: a tiny one)")
    p.add_argument("--arch", default="qwen2_vl", help="tiny checkpoint arch without --model-path")
    p.add_argument(
        "--workload", default="random", help=f"comma list of {', '.join(WORKLOADS)}, or all"
    )
    p.add_argument("--image-sizes", default=None, help="random workload: e.g. 448x448,224x336")
    p.add_argument("--random-images", type=int, default=8)
    p.add_argument("--min-size", type=int, default=112)
    p.add_argument("--max-size", type=int, default=448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-tiles",
        type=int,
        default=None,
        help="a family that tiles images: the most tiles per image (default: the checkpoint's; "
        "a family whose crops are a switch, e.g. pan-and-scan, crops above 1)",
    )
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
    p.add_argument("--encoder-costs", default=None, help="auto mode: cost JSON, no calibration")
    p.add_argument(
        "--pin-ranks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: each rank runs on its own share of the usable CPUs (as a GPU per rank would)",
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="serve instead: each mode a fresh server, first-12 and all req/s of "
        "one client's stream (scripts/vit_served.py; needs --model-path)",
    )
    p.add_argument("--requests", type=int, default=32, help="--served: timed requests")
    p.add_argument("--rounds", type=int, default=2, help="--served: server starts per mode")
    p.add_argument("--server-flags", default="", help="--served: more launch.py flags")
    p.add_argument("--log-dir", default=None, help="--served: keep the server logs here")
    p.add_argument("--json", default=None, help="write the results here")
    bench_vit_serving.add_serving_args(p)
    p.add_argument("--plot", default=None, help="write a bar chart here (needs matplotlib)")
    args = p.parse_args(argv)
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.workloads = names
    if args.served and not args.model_path:
        p.error("--served needs --model-path")
    return args


def image_sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.image_sizes:
        return [tuple(int(x) for x in s.split("x")) for s in args.image_sizes.split(",")]
    rng = random.Random(args.seed)
    return [
        (rng.randint(args.min_size, args.max_size), rng.randint(args.min_size, args.max_size))
        for _ in range(args.random_images)
    ]


def workload_batches(name: str, args: argparse.Namespace) -> list[list[tuple[int, int, int]]]:
    """A workload as a list of batches of (frames, height, width) items (`mixed` without its
    video batch where the checkpoint takes no videos: `args.videos`)."""
    if name == "random":
        return [[(1, h, w) for h, w in image_sizes(args)]]
    if name == "mixed":
        names = [n for n in NAMED if args.videos or n != "video"]
        return [batch for n in names for batch in NAMED[n]]
    return NAMED[name]


def checkpoint_workloads(args: argparse.Namespace, model_path: str) -> list[str]:
    """The workloads this checkpoint can run: without `video` where its family takes no videos
    (SystemExit where --workload names it)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    args.videos = Modality.VIDEO in family_for(config).modalities
    if args.videos:
        return args.workloads
    if "video" in args.workload.split(","):
        raise SystemExit("--workload video: this checkpoint's family takes no videos")
    return [name for name in args.workloads if name != "video"]


# The bench's pixel bounds under a resize rule: wide open, so an 896x896 image keeps its size.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 16384 * 28 * 28


def bench_spec(model_path: str, max_tiles: int | None) -> ProcessorSpec:
    """The checkpoint's processor settings as the server reads them, with the bench's pixel
    bounds and, where given, its own cap on an image's tiles (a family that tiles)."""
    spec = ProcessorSpec.from_checkpoint(model_path, MediaLimits())
    bounds = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    tiles = {} if max_tiles is None else {"max_tiles": max_tiles}
    image = dataclasses.replace(spec.image, **bounds, **tiles)
    video = dataclasses.replace(spec.video, **bounds)
    return dataclasses.replace(spec, image=image, video=video)


def item_grid(spec: ProcessorSpec, frames: int, height: int, width: int) -> list[int]:
    """An item's patch grid as the family's processor makes it: an image's resize or tiles
    (`Family.tiling`: its tiles and thumbnail, or its crops), a video's resized frames."""
    if frames == 1:
        return list(spec.image_grid(height, width))
    return list(spec.video_grid(frames, height, width))


def make_batch(
    cfg: ModelConfig, spec: ProcessorSpec, items: list[tuple[int, int, int]], seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Random patch rows for `items` and their grids."""
    grids = [item_grid(spec, *item) for item in items]
    total = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, cfg.vision.patch_dim, generator=gen), grids


def build_tower(
    cfg: ModelConfig, model_path: str, tp: TPGroup, device: str, dtype: torch.dtype, backend: str
):
    with torch.device(device):
        tower = vision_tower_class(cfg)(cfg.vision, tp, get_kernel_ops(backend)).to(dtype)
    weights = []
    for name, w in iterate_weights(model_path):
        name = cfg.family.checkpoint_name(name)
        if name.startswith("visual."):
            weights.append((name[len("visual.") :], w))
    tower.load_weights(weights)
    return tower.eval()


class Runner:
    """One rank's three ways to encode a batch, each with its own collective counter."""

    def __init__(self, tp_tower, full_tower, base: TPGroup, costs: EncoderCosts):
        self.tp_tower, self.full_tower, self.base = tp_tower, full_tower, base
        self.groups = {m: CountingGroup(base) for m in MODES}
        shape = TowerShape.of(full_tower.cfg, full_tower.dtype.itemsize)
        self.history = CallLog()
        self.auto = AutoEncoder(
            full_tower, self.groups["auto"], shape, costs, observer=self.history
        )

    def run(self, mode: str, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        group = self.groups[mode]
        if mode == "tp":
            return self.tp_tower(pixels, torch.tensor(grids, dtype=torch.long))
        if mode == "dp":
            merge = self.full_tower.spatial_merge_size
            return run_dp_over_frames(self.full_tower, pixels, grids, group, merge)
        return self.auto(pixels, grids)


def time_interleaved(
    runner: Runner, batches: list, args: argparse.Namespace, device: str
) -> tuple[dict[str, list[float]], list[int]]:
    """Seconds per batch for every mode, the modes taking turns (in a rotating order), and
    where each round ends in auto's history."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    ends = []
    for i in range(args.warmup + args.repeat):
        for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
            if runner.base.size > 1:
                torch.distributed.barrier(group=runner.base.cpu_group)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for pixels, grids in batches:
                runner.run(mode, pixels, grids)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[mode].append((time.perf_counter() - start) / len(batches))
        ends.append(len(runner.history))
    return times, ends


def rounds_of(history: list[CallRecord], start: int, ends: list[int]) -> list[dict[str, int]]:
    """Auto's plan counts per round (an explored plan counts also under "explored")."""
    out = []
    for end in ends:
        calls = history[start:end]
        counts = Counter(c.kind for c in calls) + Counter("explored" for c in calls if c.explored)
        out.append(dict(sorted(counts.items())))
        start = end
    return out


def mode_loads(mode: str, runner: Runner, grids_list: list[list[list[int]]]) -> list[int]:
    """Patches each rank processes over the workload (TP items count on every rank)."""
    size = runner.base.size
    loads = [0] * size
    for grids in grids_list:
        sizes = [t * h * w for t, h, w in frame_units(grids)]  # DP and auto plan over these
        ranks: tuple[tuple[int, ...], ...] = ()
        if mode == "tp":
            tp_items, dp_items = range(len(sizes)), []
        elif mode == "dp":
            tp_items, dp_items = [], range(len(sizes))
        else:  # auto's DP part balanced by modeled time
            plan = runner.auto.plan(grids)
            tp_items, dp_items, ranks = plan.tp_items, plan.dp_items, plan.dp_ranks
        shared = sum(sizes[i] for i in tp_items)
        dp_sizes = [sizes[i] for i in dp_items]
        if ranks:
            dp_loads = [sum(dp_sizes[j] for j in mine) for mine in ranks]
        else:
            _, _, dp_loads = get_dp_encoder_lb_assignment(dp_sizes, size)
        loads = [a + shared + b for a, b in zip(loads, dp_loads)]
    return loads


def summarize(
    workload: str,
    mode: str,
    times: list[float],
    n_items: float,
    loads: list[int],
    nbytes: int,
    plans: dict[str, int],
    rounds: list[dict[str, int]],
) -> ModeResult:
    times_ms = sorted(t * 1e3 for t in times)
    p90 = times_ms[min(len(times_ms) - 1, int(round(0.9 * (len(times_ms) - 1))))]
    median = statistics.median(times_ms)
    mean_load = sum(loads) / len(loads)
    return ModeResult(
        workload,
        mode,
        median,
        p90,
        n_items / (median / 1e3),
        loads,
        max(loads) / mean_load if mean_load else 1.0,
        nbytes,
        plans,
        rounds,
        [t * 1e3 for t in times],
    )


def rank_main(rank: int, args: argparse.Namespace, model_path: str, port: int, queue) -> None:
    keep_freed_memory()  # as every server process does: freed buffers are not faulted in again
    device = "cuda" if args.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        own = rank_cpus(rank, args.tp) if args.pin_ranks else None
        if own:
            os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own) if own else threads_per_rank(args.tp))
    try:
        base = init_tp_group(rank, args.tp, f"tcp://127.0.0.1:{port}", use_cuda=device == "cuda")
        try:
            queue.put((rank, run_rank(args, model_path, base, device)))
        finally:
            destroy_tp_group()
    except BaseException:  # the parent stops the run with this rank's error, and prints it
        queue.put((rank, RankFailure(traceback.format_exc())))
        raise SystemExit(1) from None


def run_rank(args: argparse.Namespace, model_path: str, base: TPGroup, device: str) -> dict:
    cfg = ModelConfig.from_dir(model_path)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    backend = args.attention_backend
    with torch.inference_mode():
        tp_tower = build_tower(cfg, model_path, CountingGroup(base), device, dtype, backend)
        full = build_tower(cfg, model_path, TPGroup(), device, dtype, backend)
        if args.encoder_costs:
            costs = EncoderCosts.from_json(args.encoder_costs)
        else:
            costs = calibrate_encoder_costs(full, base, TowerShape.of(full.cfg, dtype.itemsize))
        runner = Runner(tp_tower, full, base, costs)
        spec = bench_spec(model_path, args.max_tiles)
        results, workloads = [], []
        for name in args.workloads:
            rows = run_workload(name, runner, cfg, spec, args, device, dtype)
            results += [asdict(r) for r in rows]
            workloads += [name] * (len(runner.history) - len(workloads))
    history = [{"workload": w, **asdict(c)} for w, c in zip(workloads, runner.history)]
    return {"calibration": json.loads(costs.to_json()), "results": results, "auto_history": history}


def run_workload(
    name: str,
    runner: Runner,
    cfg: ModelConfig,
    spec: ProcessorSpec,
    args: argparse.Namespace,
    device: str,
    dtype: torch.dtype,
) -> list[ModeResult]:
    batches = []
    for i, items in enumerate(workload_batches(name, args)):
        pixels, grids = make_batch(cfg, spec, items, args.seed + i)
        batches.append((pixels.to(device=device, dtype=dtype), grids))
    runner.auto.plan_counts.clear()
    for group in [runner.tp_tower.tp, *runner.groups.values()]:
        group.counter[0] = 0
    start = len(runner.history)
    times, ends = time_interleaved(runner, batches, args, device)
    rounds = rounds_of(runner.history, start, ends)
    runs = (args.warmup + args.repeat) * len(batches)
    n_items = sum(len(g) for _, g in batches) / len(batches)
    grids_list = [g for _, g in batches]
    out = []
    for mode in MODES:
        group = runner.tp_tower.tp if mode == "tp" else runner.groups[mode]
        loads = mode_loads(mode, runner, grids_list)
        plans = dict(runner.auto.plan_counts) if mode == "auto" else {}
        out.append(
            summarize(
                name,
                mode,
                times[mode],
                n_items,
                loads,
                group.counter[0] // runs,
                plans,
                rounds if mode == "auto" else [],
            )
        )
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankFailure:
    """What a rank that raised puts on the result queue: its traceback."""

    traceback: str


class RankError(RuntimeError):
    """A rank failed (raised, or exited without its result); the run stops."""


RUN_TIMEOUT_S = 1800.0  # the whole run, every rank's result in


def spawn(args: argparse.Namespace, model_path: str) -> dict:
    """Run every rank; returns rank 0's results. The first rank to fail (an error, or an exit
    without a result) stops the run with its message; children are always reaped."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args, model_path, port, queue), daemon=True)
        for r in range(args.tp)
    ]
    for p in procs:
        p.start()
    try:
        results = collect(queue, procs, time.monotonic() + RUN_TIMEOUT_S)
    except BaseException:
        reap(procs, grace_s=0)
        raise
    reap(procs, grace_s=10)
    return results[0]


def collect(queue, procs: list, deadline: float) -> dict[int, dict]:
    """Every rank's result by rank, polling the queue and the ranks' liveness."""
    results: dict[int, dict] = {}
    while len(results) < len(procs):
        try:
            rank, result = queue.get(timeout=0.5)
        except Empty:
            check_alive(queue, procs, results, deadline)
            continue
        if isinstance(result, RankFailure):
            raise RankError(f"rank {rank} failed:\n{result.traceback}")
        results[rank] = result
    return results


def check_alive(queue, procs: list, results: dict[int, dict], deadline: float) -> None:
    """RankError for a rank that exited without its result (the error of a rank whose message
    is still in the queue's pipe first), or for a run past its deadline."""
    dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
    if dead:
        try:
            rank, result = queue.get(timeout=2)
        except Empty:
            rank, result = dead[0], None
        if isinstance(result, RankFailure):
            raise RankError(f"rank {rank} failed:\n{result.traceback}")
        if result is not None:
            results[rank] = result
            return
        raise RankError(f"rank {rank} exited with code {procs[rank].exitcode} without a result")
    if time.monotonic() > deadline:
        raise RankError(f"the ranks gave no result in {RUN_TIMEOUT_S:.0f} s")


def reap(procs: list, grace_s: float) -> None:
    """End every rank: `grace_s` for those finishing, then kill the rest."""
    stop = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, stop - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def print_table(out: dict, args: argparse.Namespace) -> None:
    print(f"ViT benchmark: tp={args.tp}, device={args.device}, times per batch")
    print(f"auto mode cost model: {json.dumps(out['calibration'])}")
    head = f"{'workload':<22}{'mode':<6}{'median ms':>11}{'p90 ms':>9}{'items/s':>9}"
    print(head + f"{'imbalance':>11}{'coll. MB/rank':>15}  plans / patches per rank")
    for r in out["results"]:
        extra = r["plans"] if r["mode"] == "auto" else r["patches_per_rank"]
        print(
            f"{r['workload']:<22}{r['mode']:<6}{r['median_ms']:>11.2f}{r['p90_ms']:>9.2f}"
            f"{r['items_per_s']:>9.1f}{r['imbalance']:>11.2f}"
            f"{r['collective_bytes_per_rank'] / 1e6:>15.2f}  {extra}"
        )
    for name, by_mode in group_by_workload(out["results"]).items():
        tp, dp, auto = (by_mode[m]["median_ms"] for m in MODES)
        print(
            f"{name}: DP speed-up over TP {tp / dp:.2f}x; auto vs TP {tp / auto:.2f}x, "
            f"vs DP {dp / auto:.2f}x, vs the better static mode {min(tp, dp) / auto:.2f}x "
            f"(paired per round: {paired_ratio(by_mode):.2f}x)"
        )
        print(f"{name}: auto's plans per round: {by_mode['auto']['plans_per_round']}")


def paired_ratio(by_mode: dict[str, dict]) -> float:
    """Median over the timed rounds of the better static mode's time (the one with the lower
    median) over auto's in the same round: the modes of a round run back to back, so a slow
    spell of the machine that spans a round cancels, which a ratio of medians keeps."""
    better = min(("tp", "dp"), key=lambda m: by_mode[m]["median_ms"])
    pairs = zip(by_mode[better]["round_ms"], by_mode["auto"]["round_ms"])
    return statistics.median(static / auto for static, auto in pairs)


def group_by_workload(results: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in results:
        out.setdefault(r["workload"], {})[r["mode"]] = r
    return out


def plot(out: dict, path: str) -> None:
    """Medians per workload and mode; auto's plan per call; its learned ratios per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, choice, ratios) = plt.subplots(3, 1, figsize=(9, 9))
    plot_medians(bars, out["results"])
    plot_history(choice, ratios, out["auto_history"])
    fig.tight_layout()
    fig.savefig(path)


def plot_medians(ax, results: list[dict]) -> None:
    grouped = group_by_workload(results)
    names = list(grouped)
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        xs = [i + (j - 1) * width for i in range(len(names))]
        ax.bar(xs, [grouped[n][mode]["median_ms"] for n in names], width, label=mode)
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_ylabel("median ms per batch")
    ax.legend()


def plot_history(choice, ratios, history: list[dict]) -> None:
    """Auto's plan per call (explorations as crosses) and each kind's learned ratio, with the
    workloads' boundaries marked."""
    kinds = ("dp", "tp", "hybrid")
    calls = range(len(history))
    for explored, marker in ((False, "o"), (True, "x")):
        xs = [i for i in calls if history[i]["explored"] == explored]
        ys = [kinds.index(history[i]["kind"]) for i in xs]
        choice.scatter(xs, ys, marker=marker, s=12, label="explored" if explored else "greedy")
    choice.set_yticks(range(len(kinds)), kinds)
    choice.set_ylabel("auto's plan")
    choice.legend(fontsize=8)
    for kind in kinds:
        ratios.plot(calls, [h["ratios"][kind] for h in history], label=kind)
    ratios.set_yscale("log")
    ratios.set_ylabel("learned measured / modeled")
    ratios.set_xlabel("auto call")
    ratios.legend(fontsize=8)
    for i in calls:
        if i and history[i]["workload"] != history[i - 1]["workload"]:
            for ax in (choice, ratios):
                ax.axvline(i - 0.5, color="grey", lw=0.5)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.served:
        from vit_served import print_served, run_served

        out = run_served(args)
        print_served(out, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=2))
        return
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= args.tp else "cpu"
    if args.attention_backend == "auto":
        args.attention_backend = "triton" if args.device == "cuda" else "torch"
    if args.serving:  # the tower placed as servers: scripts/bench_vit_serving.py
        with tempfile.TemporaryDirectory() as tmp:
            model_path = args.model_path or tiny_checkpoint(args.arch, tmp)
            out = bench_vit_serving.main(args, model_path, Path(tmp))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or tiny_checkpoint(args.arch, tmp)
        args.workloads = checkpoint_workloads(args, model_path)
        try:
            out = spawn(args, model_path)
        except RankError as exc:
            raise SystemExit(f"bench_vit_dp_vs_tp: {exc}") from None
    print_table(out, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=2))
    if args.plot:
        plot(out, args.plot)


def tiny_checkpoint(arch: str, tmp: str) -> str:
    from runtime.tiny_checkpoint import make_checkpoint

    return str(make_checkpoint(arch, Path(tmp) / arch))


if __name__ == "__main__":
    main()
