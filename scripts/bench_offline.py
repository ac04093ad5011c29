"""Offline benchmark: tessera's engine against HF transformers `generate`, and against the floors.

    python scripts/bench_offline.py --preset 7b --batch-sizes 1,32 --output-len 128 --json out.json
    python scripts/bench_offline.py --model-path DIR --device cuda --dtype bfloat16

One process, one rank. The same image+text prompts (one image each, every image different, all
of the same size so every prompt has the same length and HF needs no padding) go through:

- tessera: the real scheduler (continuous batching, radix and encoder caches, sampler) driven
  in-process; all requests arrive at once. TTFT is the time until a request's first token,
  throughput is output tokens over the wall time of the whole batch.
- HF transformers: `generate` on the same checkpoint, greedy, a fixed number of new tokens;
  TTFT is `generate` with one new token.

Floors, measured in the same run:
- decode step at batch 1 >= bytes of weights read per step / device-to-device copy bandwidth;
- vision tower time >= its FLOPs / the measured matmul rate in the model's dtype.

Greedy outputs of both engines are compared at batch 1 and reported (`greedy_match`).
`--temperature T` (above 0) has tessera's requests sample instead (unseeded, as most clients): a
sampled decode step's cost, with or without overlap; HF is then not run (its greedy tokens are
not comparable).

`--varlen-attention` runs only the vision towers' segment attention on a GPU: the Triton kernel
at several tile sizes against the torch path (equal-length segments batched into
scaled_dot_product_attention), at the shapes of Qwen2.5-VL-7B's tower on `--varlen-images`
448x448 images (1024 patches each, 16 heads of 80; windowed blocks attend inside 64-patch
windows, full blocks over each image's 1024 patches). Each variant's output is checked against
the torch path and timed with CUDA events: milliseconds and the attention's TFLOP/s
(4 * length^2 * width per segment).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from runtime.distributed import TPGroup  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.model_config import ModelConfig  # noqa: E402
from runtime.multimodal import Modality  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import hf_model_class, make_checkpoint  # noqa: E402
from scheduler.process import build_scheduler  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from tokenizer_manager.front_end import build_front_end  # noqa: E402
from tokenizer_manager.media.multimodal_inputs import PreparedMedia  # noqa: E402
from tokenizer_manager.media.worker import image_processor  # noqa: E402
from vision.qwen2_5_vl_vit import window_index  # noqa: E402
from vision.vit_common import frame_cu_seqlens  # noqa: E402

VARLEN_TILES = ((32, 32), (64, 32), (64, 64), (128, 64))
VARLEN_HEADS, VARLEN_HEAD_DIM, VARLEN_PATCHES = 16, 80, 1024

PROMPT = "Describe this picture in detail, then say what might happen next."


@dataclass
class Prompt:
    """One request: tessera's tokenized message and the HF model's inputs."""

    ours: TokenizedGenerateReq
    hf_ids: list[int]
    media: PreparedMedia


# ---------------------------------------------------------------- prompts


def make_prompts(
    args: argparse.Namespace, server: ServerArgs, count: int, params: SamplingParams
) -> list[Prompt]:
    from PIL import Image

    tm = build_front_end(server, media=None).tm
    processor = image_processor(server.model_path)
    rng = np.random.default_rng(args.seed)
    h, w = args.image_size
    prompts = []
    for i in range(count):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        media = PreparedMedia(Modality.IMAGE, out["pixel_values"], grid)
        image_part = {"type": "image_url", "image_url": {"url": ""}}
        content = [image_part, {"type": "text", "text": PROMPT}]
        text, _ = tm.render_chat([{"role": "user", "content": content}])
        ids = tm.tokenize(text, [media])
        prompts.append(Prompt(tm.build_request(f"r{i}", ids, [media], params, False), ids, media))
    return prompts


def hf_inputs(model: Any, prompts: list[Prompt], device: str, dtype: torch.dtype) -> dict:
    cfg = model.config
    ids = torch.tensor([p.hf_ids for p in prompts], device=device)
    types = (ids == cfg.image_token_id).long()
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": types,
        "pixel_values": torch.cat([p.media.pixel_values for p in prompts]).to(device, dtype),
        "image_grid_thw": torch.tensor([p.media.grid_thw for p in prompts], device=device),
    }


# ---------------------------------------------------------------- timing helpers


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


# ---------------------------------------------------------------- tessera


def run_tessera(scheduler: Scheduler, prompts: list[Prompt], device: str) -> dict[str, Any]:
    """Submit every prompt at once and step until all are done."""
    sync(device)
    start = time.perf_counter()
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {p.ours.rid: [] for p in prompts}
    logprobs: dict[str, list[Any]] = {p.ours.rid: [] for p in prompts}
    decode_steps: list[float] = []
    messages: list[object] = [p.ours for p in prompts]
    done = 0
    while done < len(prompts):
        decodes = scheduler.counters.decode_steps
        step_start = time.perf_counter()
        # no device sync here: a step reads its own tokens (with overlap, the previous step's),
        # and that read is what the host waits for
        result = scheduler.step(messages)
        now = time.perf_counter()
        messages = []
        if scheduler.counters.decode_steps > decodes and len(scheduler.running) == len(prompts):
            decode_steps.append(now - step_start)
        for out in result.outputs:
            if out.new_token_ids and out.rid not in first:
                first[out.rid] = now - start
            tokens[out.rid].extend(out.new_token_ids)
            logprobs[out.rid].extend(out.logprobs or [])
            if out.finish_reason is not None:
                if not out.finish_reason.completed:
                    raise RuntimeError(f"request {out.rid} ended with {out.finish_reason}")
                done += 1
    total = time.perf_counter() - start
    out_tokens = sum(len(t) for t in tokens.values())
    ttft = sorted(first.values())
    return {
        "seconds": total,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / total,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_max_s": ttft[-1],
        "decode_step_median_s": statistics.median(decode_steps) if decode_steps else None,
        "tokens": [tokens[p.ours.rid] for p in prompts],
        "logprobs": [logprobs[p.ours.rid] for p in prompts],  # when the prompts asked for them
    }


def profile_decode(
    scheduler: Scheduler, prompt: Prompt, device: str, steps: int, out_dir: Path | None
) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes: `steps` steps under torch's profiler, after the
    prefill and one decode. `device_ms_per_step` sums the step's kernels (and copies) on the
    device; the rest of `wall_ms_per_step` is the host (scheduler, sampler, launches, the token's
    copy back) with the device idle. Writes the op tables and a Chrome trace to `out_dir`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    messages: list[object] = [prompt.ours]
    produced = finished = 0

    def step() -> None:
        nonlocal messages, produced, finished
        result = scheduler.step(messages)
        messages = []
        for out in result.outputs:
            produced += len(out.new_token_ids)
            finished += out.finish_reason is not None

    while produced < 2 and not finished:
        step()
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = time.perf_counter() - start
    profiled = produced
    while not finished:
        step()
    kernels = device_kernel_us(prof)
    device_us = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
        if device == "cuda":
            tables.append(averages.table(sort_by="self_device_time_total", row_limit=30))
        (out_dir / "decode_profile.txt").write_text("\n\n".join(tables))
        prof.export_chrome_trace(str(out_dir / "decode_trace.json"))
    return {
        "steps": steps,
        "tokens_during_profile": profiled,
        "wall_ms_per_step": wall * 1e3 / steps,
        "device_ms_per_step": device_us / 1e3 / steps if device == "cuda" else None,
        "device_busy_fraction": device_us / 1e6 / wall if device == "cuda" else None,
        "top_device_ms_per_step": {name[:80]: us / 1e3 / steps for name, us in top},
    }


def device_kernel_us(prof: Any) -> dict[str, float]:
    """Microseconds on the device per kernel (and copy) name, summed over a profile."""
    from torch.autograd import DeviceType

    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us()
    return kernels


def profile_vision(
    model: torch.nn.Module, prompts: list[Prompt], device: str, out_dir: Path | None = None
) -> dict[str, Any]:
    """Where one vision-tower call over every prompt's image spends the device's time: the
    top kernels in ms, and their sum against the call's wall time (after a warm-up call).
    `out_dir` gets `vision_profile.txt`: the torch ops by the device time of the kernels they
    launched (which op a copy kernel belongs to, say)."""
    from torch.profiler import ProfilerActivity, profile

    pixels = torch.cat([p.media.pixel_values for p in prompts]).to(device, model.visual.dtype)
    grid = torch.tensor([p.media.grid_thw for p in prompts])
    with torch.inference_mode():
        model.visual(pixels, grid)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            model.visual(pixels, grid)
            sync(device)
            wall = time.perf_counter() - start
    kernels = device_kernel_us(prof)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=40)
        (out_dir / "vision_profile.txt").write_text(table)
    return {
        "patches": int(pixels.shape[0]),
        "wall_ms": wall * 1e3,
        "device_ms": sum(kernels.values()) / 1e3,
        "top_device_ms": {name[:80]: us / 1e3 for name, us in top},
    }


# ---------------------------------------------------------------- HF transformers


def cuda_ms(fn, repeat: int) -> float:
    """Milliseconds per call on CUDA events, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def varlen_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Any) -> dict:
    """The torch path and the Triton kernel at each tile size, as calls on the same inputs."""
    from kernels.attention.varlen import varlen_attention
    from kernels.triton.varlen_attention import varlen_attention as triton_varlen

    scale = VARLEN_HEAD_DIM**-0.5
    variants = {"torch sdpa": lambda: varlen_attention(q, k, v, segments, scale)}
    for bm, bn in VARLEN_TILES:
        variants[f"triton {bm}x{bn}"] = lambda bm=bm, bn=bn: triton_varlen(
            q, k, v, segments, scale, bm, bn
        )
    return variants


def varlen_attention_bench(images: int, repeat: int) -> dict[str, Any]:
    """Every variant on windowed and on full segments: ms, TFLOP/s and the error against torch."""
    from kernels.attention.varlen import Segments

    if not torch.cuda.is_available():
        sys.exit("bench_offline --varlen-attention: needs a CUDA device")
    tokens = images * VARLEN_PATCHES
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (3, tokens, VARLEN_HEADS, VARLEN_HEAD_DIM)
    q, k, v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16).unbind(0)
    results = {"device": torch.cuda.get_device_name(), "tokens": tokens, "rows": []}
    for kind, length in (("window", 64), ("full", VARLEN_PATCHES)):
        segments = Segments.build(torch.arange(0, tokens + 1, length, dtype=torch.int32), "cuda")
        flops = 4.0 * VARLEN_HEAD_DIM * VARLEN_HEADS * length * length * (tokens // length)
        variants = varlen_variants(q, k, v, segments)
        ref = variants["torch sdpa"]().float()
        for name, fn in variants.items():
            row = {"segments": kind, "variant": name}
            try:
                err = float((fn().float() - ref).abs().max())
                ms = cuda_ms(fn, repeat)
                row |= {"ms": round(ms, 3), "tflop_s": round(flops / ms / 1e9, 1),
                        "max_abs_err": err}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a row
                row["error"] = repr(exc)[:200]
            results["rows"].append(row)
            print(row, flush=True)
    return results


def run_hf(model: Any, prompts: list[Prompt], args: argparse.Namespace) -> dict[str, Any]:
    inputs = hf_inputs(model, prompts, args.device, model.dtype)
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    greedy = dict(do_sample=False, pad_token_id=pad)

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **greedy)

    _, ttft = timed(lambda: generate(1), args.device)
    out, seconds = timed(lambda: generate(args.output_len), args.device)
    new = out[:, inputs["input_ids"].shape[1] :]
    return {
        "seconds": seconds,
        "output_tokens": new.numel(),
        "output_tokens_per_s": new.numel() / seconds,
        "ttft_s": ttft,
        "tokens": new.tolist(),
    }


def hf_gap(
    model: Any, prompt: Prompt, args: argparse.Namespace, ours: list[int], theirs: list[int],
    at: int,
) -> float:
    """HF's own view of where the greedy outputs part: how much more likely (log-softmax, nats)
    it found its token than tessera's at that step. Near zero: a near tie that rounding decides
    (bfloat16 random weights give many); large: the engines disagree on the distribution."""
    inputs = hf_inputs(model, [prompt], args.device, model.dtype)
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=at + 1, min_new_tokens=at + 1, do_sample=False,
            pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
        )
    logp = out.logits[at][0].float().log_softmax(-1)
    return float(logp[theirs[at]] - logp[ours[at]])


# ---------------------------------------------------------------- floors


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second that a device-to-device copy moves (read + write)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timed(lambda: dst.copy_(src), device)[1] for _ in range(5)]
    return 2 * src.numel() / min(times)


def matmul_rate(device: str, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of one square matmul in the model's dtype."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    times = [timed(lambda: a @ b, device)[1] for _ in range(5)]
    return 2 * n**3 / min(times)


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Weights a decode step reads: every decoder and LM-head parameter, only `batch` embedding
    rows (the embedding table is read in full only as a tied LM head)."""
    lm = model.language_model
    embed = lm.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in lm.parameters())
    if not model.config.text.tie_word_embeddings:
        total -= embed.numel() * embed.element_size()
        total += batch * embed.shape[1] * embed.element_size()
    return total


def vision_flops(config: ModelConfig, grids: list[tuple[int, int, int]]) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of the vision tower on these items.

    `dense`: patch embedding, every block's QKV, output projection and MLP, and the mergers;
    `attention`: scores and weighted values inside each frame or window (4 * len**2 * width)."""
    v = config.vision
    grid = torch.tensor(grids)
    n = int(grid.prod(-1).sum())
    e, merge = v.embed_dim, v.spatial_merge_size**2
    gated = config.arch == "qwen2_5_vl"
    mlp = (3 if gated else 2) * e * v.intermediate_size
    mergers = 1 + v.num_deepstack  # Qwen3-VL: one more merger per DeepStack level
    merger = mergers * (n // merge) * ((merge * e) ** 2 + merge * e * v.out_hidden_size)
    dense = 2 * (n * v.patch_dim * e + v.depth * n * (4 * e * e + mlp) + merger)

    def segment_flops(cu: torch.Tensor) -> float:
        return 4.0 * e * float((cu.diff().double() ** 2).sum())

    full = segment_flops(frame_cu_seqlens(grid))
    if gated:
        cu_windows = window_index(grid, v.window_size, v.patch_size, v.spatial_merge_size)[1]
        windows = segment_flops(cu_windows)
        full_blocks = len(v.fullatt_block_indexes)
        attention = full_blocks * full + (v.depth - full_blocks) * windows
    else:
        attention = v.depth * full
    return {"dense": float(dense), "attention": attention, "total": dense + attention}


def vision_patches_per_s(model: torch.nn.Module, prompts: list[Prompt], device: str) -> float:
    pixels = torch.cat([p.media.pixel_values for p in prompts]).to(device, model.visual.dtype)
    grid = torch.tensor([p.media.grid_thw for p in prompts])
    with torch.inference_mode():
        model.visual(pixels, grid)
        times = [timed(lambda: model.visual(pixels, grid), device)[1] for _ in range(3)]
    return pixels.shape[0] / min(times)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: generated)")
    p.add_argument("--arch", default="qwen2_5_vl", help="generated checkpoint's arch")
    p.add_argument("--preset", default="tiny", choices=["tiny", "7b"])
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--image-size", default="448x448", help="HxW pixels of every image")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="measure tessera and the floors only")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (implies --skip-hf)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--profile-decode", type=int, default=0, metavar="STEPS",
                   help="profile this many batch-1 decode steps (device time against wall time)")
    p.add_argument("--disable-vit-mlp-padding", action="store_true",
                   help="keep the vision MLP's checkpoint hidden size on CUDA (to compare)")
    p.add_argument("--profile-vision", action="store_true",
                   help="profile one vision-tower call over every prompt's image (CUDA only)")
    p.add_argument("--profile-dir", default=None,
                   help="where the profile's op tables and Chrome trace go (default: none)")
    p.add_argument("--varlen-attention", action="store_true",
                   help="only time the vision towers' segment attention kernels (CUDA only)")
    p.add_argument("--varlen-images", type=int, default=32, help="--varlen-attention's images")
    p.add_argument("--varlen-repeat", type=int, default=10, help="--varlen-attention's calls")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.temperature < 0:
        p.error("--temperature must be at least 0")
    args.skip_hf = args.skip_hf or args.temperature > 0
    args.image_size = tuple(int(x) for x in args.image_size.lower().split("x"))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def server_args(args: argparse.Namespace, model_path: str, ipc_dir: str) -> ServerArgs:
    return ServerArgs(
        model_path=model_path,
        ipc_dir=ipc_dir,  # no socket is opened; set so that no temporary folder is left
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_running_requests=max(args.batch_sizes),
        max_prefill_tokens=1 << 16,
        chunked_prefill_size=1 << 16,
        max_total_tokens=args.max_total_tokens,
        mm_cache_size_mb=0,  # every image is new anyway; keep the cache out of the comparison
        disable_radix_cache=True,  # no prefix of one timed run helps the next
        disable_overlap_schedule=args.disable_overlap_schedule,
        disable_vit_mlp_padding=args.disable_vit_mlp_padding,
    ).resolve()


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({torch.get_num_threads()} threads)"


def floors_for(
    model: torch.nn.Module, prompts: list[Prompt], args: argparse.Namespace, dtype: torch.dtype
) -> dict[str, float]:
    gpu = args.device == "cuda"
    bandwidth = copy_bandwidth(args.device, 1024 if gpu else 256)
    rate = matmul_rate(args.device, dtype, 8192 if gpu else 1024)
    weight_bytes = decode_weight_bytes(model, 1)
    flops = vision_flops(model.config, [p.media.grid_thw for p in prompts])["total"]
    patches = sum(int(np.prod(p.media.grid_thw)) for p in prompts)
    return {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "matmul_tflop_s": rate / 1e12,
        "decode_weight_bytes": weight_bytes,
        "decode_step_floor_s": weight_bytes / bandwidth,
        "vision_patches_per_s": vision_patches_per_s(model, prompts, args.device),
        "vision_patches_per_s_floor": patches / (flops / rate),
    }


def compare_greedy(ours: list[int], theirs: list[int], eos: set[int]) -> dict[str, Any]:
    """HF was made to run the full length (min_new_tokens), so compare up to our first EOS."""
    end = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    same = next((i for i, (a, b) in enumerate(zip(ours[:end], theirs)) if a != b), end)
    return {"greedy_match": same == end, "greedy_tokens_compared": end, "greedy_same_prefix": same}


def run(args: argparse.Namespace, model_path: str, tmp: str) -> dict[str, Any]:
    server = server_args(args, model_path, tmp)
    if server.use_cuda:
        torch.cuda.set_device(0)
    scheduler = build_scheduler(server, TPGroup())
    model = scheduler.runner.model
    dtype = next(model.parameters()).dtype
    params = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.output_len, ignore_eos=True
    )
    prompts = make_prompts(args, server, max(args.batch_sizes), params)
    for b in args.batch_sizes:  # warm-up: each size's kernels compiled, its decode graph captured
        run_tessera(scheduler, prompts[:b], args.device)
    results: dict[str, Any] = {"device": device_name(args.device), "dtype": str(dtype)}
    results["prompt_tokens"] = len(prompts[0].ours.input_ids)
    results["tessera"] = {
        b: run_tessera(scheduler, prompts[:b], args.device) for b in args.batch_sizes
    }
    results["floors"] = floors_for(model, prompts, args, dtype)
    if args.profile_decode:
        out_dir = Path(args.profile_dir) if args.profile_dir else None
        results["decode_profile"] = profile_decode(
            scheduler, prompts[0], args.device, args.profile_decode, out_dir
        )
    if args.profile_vision and args.device == "cuda":
        out_dir = Path(args.profile_dir) if args.profile_dir else None
        results["vision_profile"] = profile_vision(model, prompts, args.device, out_dir)
    eos = set(model.config.eos_token_ids)
    del scheduler, model
    if args.skip_hf:
        return results
    if server.use_cuda:
        torch.cuda.empty_cache()
    arch = ModelConfig.from_dir(model_path).arch
    hf = hf_model_class(arch).from_pretrained(model_path, dtype=dtype).to(args.device).eval()
    run_hf(hf, prompts[:1], args)  # warm-up
    results["hf"] = {b: run_hf(hf, prompts[:b], args) for b in args.batch_sizes}
    smallest = min(args.batch_sizes)
    ours, theirs = results["tessera"][smallest]["tokens"][0], results["hf"][smallest]["tokens"][0]
    results.update(compare_greedy(ours, theirs, eos))
    if not results["greedy_match"]:
        at = results["greedy_same_prefix"]
        results["hf_gap_at_difference_nats"] = hf_gap(hf, prompts[0], args, ours, theirs, at)
    return results


def ratios(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    floors = results["floors"]
    if 1 in results["tessera"] and results["tessera"][1]["decode_step_median_s"]:
        out["decode_step_b1_over_floor"] = (
            results["tessera"][1]["decode_step_median_s"] / floors["decode_step_floor_s"]
        )
    out["vision_floor_over_measured"] = (
        floors["vision_patches_per_s_floor"] / floors["vision_patches_per_s"]
    )
    for b, ours in results["tessera"].items():
        if "hf" in results:
            hf = results["hf"][b]
            out[f"throughput_vs_hf_b{b}"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
            out[f"ttft_hf_over_tessera_b{b}"] = hf["ttft_s"] / ours["ttft_mean_s"]
    return out


def print_table(results: dict[str, Any]) -> None:
    print(f"device: {results['device']}, dtype {results['dtype']}, "
          f"{results['prompt_tokens']} prompt tokens per request")
    print(f"{'engine':<8} {'batch':>5} {'out tok/s':>11} {'TTFT ms':>9} {'decode ms':>10}")
    for b, r in results["tessera"].items():
        step = r["decode_step_median_s"]
        step_ms = f"{step * 1e3:10.2f}" if step else f"{'-':>10}"
        print(f"{'tessera':<8} {b:>5} {r['output_tokens_per_s']:11.1f} "
              f"{r['ttft_mean_s'] * 1e3:9.1f} {step_ms}")
    for b, r in results.get("hf", {}).items():
        print(f"{'hf':<8} {b:>5} {r['output_tokens_per_s']:11.1f} {r['ttft_s'] * 1e3:9.1f} "
              f"{'-':>10}")
    f = results["floors"]
    print(f"copy bandwidth {f['copy_bandwidth_gb_s']:.1f} GB/s, matmul {f['matmul_tflop_s']:.2f} "
          f"TFLOP/s, decode floor {f['decode_step_floor_s'] * 1e3:.3f} ms "
          f"({f['decode_weight_bytes'] / 1e6:.1f} MB of weights)")
    print(f"vision: {f['vision_patches_per_s']:.0f} patches/s, floor "
          f"{f['vision_patches_per_s_floor']:.0f} patches/s")
    for name, value in results["ratios"].items():
        print(f"{name:<32} {value:8.2f}")
    if "decode_profile" in results:
        prof = results["decode_profile"]
        device_ms = prof["device_ms_per_step"]
        on_device = f", on the device {device_ms:.3f} ms" if device_ms is not None else ""
        print(f"decode profile: {prof['wall_ms_per_step']:.3f} ms per step{on_device}")
        for name, ms in prof["top_device_ms_per_step"].items():
            print(f"  {ms:8.3f} ms  {name}")
    if "vision_profile" in results:
        prof = results["vision_profile"]
        print(f"vision profile: {prof['patches']} patches, {prof['wall_ms']:.2f} ms, on the "
              f"device {prof['device_ms']:.2f} ms")
        for name, ms in prof["top_device_ms"].items():
            print(f"  {ms:8.3f} ms  {name}")
    if "greedy_match" in results:
        print(f"greedy outputs equal to HF: {results['greedy_match']} "
              f"({results['greedy_same_prefix']}/{results['greedy_tokens_compared']} tokens)")
    if "hf_gap_at_difference_nats" in results:
        print(f"at the first difference HF preferred its token by "
              f"{results['hf_gap_at_difference_nats']:.3g} nats")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.varlen_attention:
        results = varlen_attention_bench(args.varlen_images, args.varlen_repeat)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return results
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if model_path is None:
            model_path = str(make_checkpoint(args.arch, Path(tmp) / "ck", args.preset))
        results = run(args, model_path, tmp)
    results["ratios"] = ratios(results)
    print_table(results)
    if args.json:
        for engine in ("tessera", "hf"):
            for r in results.get(engine, {}).values():
                r.pop("tokens")
                r.pop("logprobs", None)
        results["args"] = dict(vars(args))
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
