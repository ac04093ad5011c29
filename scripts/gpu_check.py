"""Validate a GPU node for tessera in one command: tests, kernel parity, one served image chat.

    bash scripts/install.sh test && pip install -e ".[gpu]"
    python scripts/gpu_check.py                      # every check, report in gpu_check.json
    python scripts/gpu_check.py --checks gpu_tests,parity_tiny --json report.json

Checks (each timed, each caught: one failing check does not stop the others):
- gpu_tests: every `@pytest.mark.gpu` test, then the Triton kernel and model tests natively and
  the sm_80/sm_90 compile check (pytest in subprocesses);
- parity_tiny: greedy tokens of two image prompts through the real scheduler with the torch
  attention backend and with the Triton one, on each tiny checkpoint (float32): all equal;
- parity_7b: the same on a 7B-shaped random Qwen2.5-VL checkpoint (written to a temporary
  folder in bfloat16, about 16 GB; run in float32): equal up to, at most, a first difference
  that is a near tie in both (--margin-7b nats), or, where the tokens part, the two runs'
  activations drift apart smoothly, block by block and layer by layer, from float32 rounding
  with no step where a kernel would have put them apart (see `drift_profile`);
- serve: launch.py with --tp equal to the visible GPUs (NCCL) on a tiny checkpoint, one image
  chat through the official openai client, then a clean stop.

Writes a JSON report (device, versions, each check with its time and detail) and prints a table.
Exit status: 0 all passed, 1 a check failed, 2 no CUDA device here (nothing was run).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import io
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

CHECKS = ("gpu_tests", "parity_tiny", "parity_7b", "serve")
TINY_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# every @pytest.mark.gpu test, then the Triton tests that run natively on a GPU
PYTEST_RUNS = (
    ["-m", "gpu", "tests"],
    ["tests/test_triton_kernels.py", "tests/test_triton_model.py", "tests/test_triton_compile.py"],
)


@dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: str


def run_check(name: str, fn: Callable[[], str]) -> CheckResult:
    """Run one check; its return value is the detail, an exception fails it (with the trace).

    Whatever the check held on the device is handed back to the driver after it, also when it
    failed half way (its frames, held in cycles by the traceback, go with a collection): the
    next check, or the server process the serve check starts, must find the memory free."""
    start = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as exc:  # noqa: BLE001 - a failed check is a row of the report
        detail, ok = f"{exc!r}\n{traceback.format_exc(limit=8)}", False
    finally:
        release_device_memory()
    return CheckResult(name, ok, round(time.perf_counter() - start, 2), detail)


def release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the checks


def check_gpu_tests(opts: argparse.Namespace) -> str:
    summaries = []
    for args in PYTEST_RUNS:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=opts.timeout)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
        if proc.returncode != 0:
            raise RuntimeError(f"pytest {' '.join(args)} failed:\n" + "\n".join(tail))
        summaries.append(tail[-1] if tail else "no output")
    return "; ".join(summaries)


@dataclass
class Greedy:
    """One prompt's greedy tokens and, per token, the raw log-probabilities of the top two."""

    tokens: list[int]
    top: list[dict[int, float]]


# The drift of a run's activations from the reference run's, stage by stage (vision blocks, the
# decoder's input, decoder layers), as the largest relative difference of one row. Float32
# rounding starts it near 1e-7 and random 7B-shaped weights grow it about 1.2-1.3x per block or
# layer; a kernel that computes something else (a wrong mask, row or rotation) puts a stage
# above MAX_FIRST_DRIFT at once, or JUMP times above the stage before it.
MAX_FIRST_DRIFT = 1e-4
JUMP = 30.0
AMPLIFIED_DRIFT = 1e-3  # tokens may part only where the drift has grown at least this far


def capture_stages(model: torch.nn.Module, stages: dict[str, list[torch.Tensor]]) -> list[Any]:
    """Hooks that keep, until the first forward of the decoder ends (the prefill of every
    prompt), each vision block's output (every encoder call), the decoder's input embeddings
    and the residual stream after each decoder layer, as float64 on the host, in that order."""
    done = [False]

    def keep(name: str, t: torch.Tensor) -> None:
        if not done[0]:
            stages.setdefault(name, []).append(t.detach().double().cpu())

    hooks = []
    for i, block in enumerate(getattr(model.visual, "blocks", [])):
        hooks.append(block.register_forward_hook(
            lambda m, args, out, name=f"vision block {i + 1}": keep(name, out)
        ))
    layers = model.language_model.model.layers
    hooks.append(layers[0].register_forward_pre_hook(
        lambda m, args: keep("decoder input", args[0])
    ))
    for i, layer in enumerate(layers):
        def after(m: Any, args: Any, out: Any, name: str = f"layer {i + 1}") -> None:
            keep(name, out[0] + out[1])  # the residual stream after the layer
        hooks.append(layer.register_forward_hook(after))
    hooks.append(layers[-1].register_forward_hook(lambda m, args, out: done.__setitem__(0, True)))
    return hooks


def drift_profile(
    ref: dict[str, list[torch.Tensor]], run: dict[str, list[torch.Tensor]]
) -> list[tuple[str, float]]:
    """(stage, the largest relative difference of one row of any of its calls) per stage."""
    profile = []
    for name, calls in ref.items():
        if len(run.get(name, [])) != len(calls):
            raise RuntimeError(f"{name}: {len(calls)} calls in one run, not in the other")
        worst = 0.0
        for x, y in zip(calls, run[name]):
            rows_x, rows_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
            rel = (rows_x - rows_y).norm(dim=-1) / rows_x.norm(dim=-1).clamp_min(1e-30)
            worst = max(worst, float(rel.max()))
        profile.append((name, worst))
    return profile


def drift_jump(profile: list[tuple[str, float]]) -> tuple[str, float] | None:
    """The first stage whose drift a kernel, not rounding, would explain (None: none)."""
    before = 0.0
    for name, drift in profile:
        if drift > max(MAX_FIRST_DRIFT, JUMP * before):
            return name, drift
        before = drift
    return None


def describe_drift(profile: list[tuple[str, float]]) -> str:
    vision = [p for p in profile if p[0].startswith("vision")]
    layers = [p for p in profile if p[0].startswith("layer")]
    picked = [*vision[:1], *vision[-1:], *[p for p in profile if p[0] == "decoder input"],
              *layers[:1], *layers[len(layers) // 2 : len(layers) // 2 + 1], *layers[-1:]]
    seen: set[str] = set()
    parts = [f"{n} {d:.1e}" for n, d in picked if not (n in seen or seen.add(n))]
    return "drift " + ", ".join(parts)


def greedy_tokens(
    model_path: str, backend: str, opts: argparse.Namespace, dtype: str = "auto",
    stages: dict[str, list[torch.Tensor]] | None = None,
) -> list[Greedy]:
    """Greedy tokens of two image prompts through the real scheduler on one device; `stages`
    (a dict to fill): the prefill's activations, stage by stage (see `capture_stages`)."""
    from bench_offline import make_prompts, parse_args, run_tessera, server_args

    from runtime.distributed import TPGroup
    from runtime.sampling_params import SamplingParams
    from scheduler.process import build_scheduler

    argv = ["--device", opts.device, "--attention-backend", backend, "--batch-sizes", "2"]
    argv += ["--dtype", dtype]
    args = parse_args([*argv, "--image-size", f"{opts.image_size}x{opts.image_size}"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-ipc-") as ipc:
        server = server_args(args, model_path, ipc)
        if server.use_cuda:
            torch.cuda.set_device(0)
        scheduler = build_scheduler(server, TPGroup())
        params = SamplingParams(
            temperature=0.0, max_new_tokens=opts.new_tokens, ignore_eos=True, logprobs=2
        )
        prompts = make_prompts(args, server, 2, params)
        hooks = [] if stages is None else capture_stages(scheduler.runner.model, stages)
        out = run_tessera(scheduler, prompts, opts.device)
        for hook in hooks:
            hook.remove()
    del scheduler
    release_device_memory()
    return [
        Greedy(tokens, [dict(lp.top) for lp in logprobs])
        for tokens, logprobs in zip(out["tokens"], out["logprobs"])
    ]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tie_gap(at: dict[int, float], mine: int, other: int) -> float:
    """How much more likely one engine found its own token than the other engine's, in nats
    (inf when the other's token is not among its top two: no near tie)."""
    return at[mine] - at[other] if other in at and mine in at else float("inf")


def compare_backends(
    model_path: str, margin: float | None, opts: argparse.Namespace, dtype: str = "auto",
    drift: bool = False,
) -> str:
    """torch vs Triton greedy tokens of two prompts. margin None: every token must agree.
    Else the tokens must agree up to a first difference, if any, that is a near tie in both
    engines: each found its own token more likely than the other's by at most `margin` nats
    (28 layers of float32 summed in other orders can swap two tokens that close).

    `drift` (with a margin): also compare the prefill's activations stage by stage. Tokens that
    part beyond the margin then pass where the drift grew smoothly (no `drift_jump`) to at least
    AMPLIFIED_DRIFT: random weights amplify float32 rounding until greedy picks part (a
    7B-shaped random model does so in float32), which says nothing of the kernels."""
    ref_stages: dict[str, list[torch.Tensor]] | None = {} if drift else None
    our_stages: dict[str, list[torch.Tensor]] | None = {} if drift else None
    ref = greedy_tokens(model_path, "torch", opts, dtype, stages=ref_stages)
    ours = greedy_tokens(model_path, "triton", opts, dtype, stages=our_stages)
    agreed = [agreed_prefix(a.tokens, b.tokens) for a, b in zip(ref, ours)]
    first = [abs(a.top[0][a.tokens[0]] - b.top[0][b.tokens[0]])
             for a, b in zip(ref, ours) if a.tokens[:1] == b.tokens[:1] and a.tokens]
    gaps = []
    for n, a, b in zip(agreed, ref, ours):
        if n < min(len(a.tokens), len(b.tokens)):
            x, y = a.tokens[n], b.tokens[n]
            gaps.append(max(tie_gap(a.top[n], x, y), tie_gap(b.top[n], y, x)))
    detail = f"tokens agreed {agreed} of {opts.new_tokens}"
    if first:
        detail += f"; first token's logprob differs by {max(first):.2g}"
    if gaps:
        detail += f"; gaps at the first differences {[round(g, 3) for g in gaps]} nats"
    exact = margin is None and min(agreed) == opts.new_tokens
    near_ties = margin is not None and all(g <= margin for g in gaps)
    amplified = False
    if ref_stages is not None and our_stages is not None:
        profile = drift_profile(ref_stages, our_stages)
        jump = drift_jump(profile)
        detail += "; " + describe_drift(profile)
        if jump is not None:
            detail += f"; a kernel's step at {jump[0]} ({jump[1]:.1e})"
        amplified = margin is not None and jump is None and profile[-1][1] >= AMPLIFIED_DRIFT
        if gaps and not near_ties and amplified:
            detail += " (the tokens part where the layers amplified rounding, not at a kernel)"
    if len(ref) != len(ours) or not (exact or near_ties or amplified):
        raise AssertionError(
            f"{detail}: torch {[a.tokens for a in ref]} triton {[b.tokens for b in ours]}"
        )
    return detail


def check_parity_tiny(opts: argparse.Namespace) -> str:
    from runtime.tiny_checkpoint import make_checkpoint

    details = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-ck-") as tmp:
        for arch in TINY_ARCHS:
            folder = str(make_checkpoint(arch, Path(tmp) / arch))
            details.append(f"{arch}: {compare_backends(folder, None, opts)}")
    return "; ".join(details)


def check_parity_7b(opts: argparse.Namespace) -> str:
    from runtime.tiny_checkpoint import make_checkpoint

    # In float32 (about 31 GB of weights): random 7B-shaped weights in bfloat16 are too close
    # to chaotic for any two implementations to agree (docs/gpu.md: already at 8 layers, HF in
    # bfloat16 does not keep float32's first token), so bfloat16 parity would test nothing.
    with contextlib.ExitStack() as stack:
        folder = opts.model_7b  # one written earlier (make_tiny_checkpoint.py --preset 7b)
        if folder is None:
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gpu-check-7b-", dir=opts.scratch)
            )
            folder = str(make_checkpoint("qwen2_5_vl", Path(tmp) / "7b", "7b"))
        return "7b float32: " + compare_backends(
            folder, opts.margin_7b, opts, "float32", drift=True
        )


def png_data_url(size: int = 224) -> str:
    from PIL import Image

    pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def check_serve(opts: argparse.Namespace) -> str:
    from openai import OpenAI
    from stress import LaunchedServer, stop_and_time

    from runtime.tiny_checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="gpu-check-serve-") as tmp:
        folder = str(make_checkpoint("qwen2_vl", Path(tmp) / "ck"))
        flags = ["--model-path", folder, "--tp", str(opts.tp), "--device", opts.device]
        server = LaunchedServer(flags, Path(tmp) / "server.log")
        try:
            server.wait_healthy(opts.timeout)
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
            image = {"url": png_data_url(opts.image_size)}
            content = [{"type": "image_url", "image_url": image},
                       {"type": "text", "text": "What is in the picture?"}]
            out = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": content}],
                max_tokens=opts.new_tokens, temperature=0.0,
            )
        finally:
            stopped = stop_and_time(server)
    usage = out.usage
    if not out.choices or usage is None or usage.completion_tokens < 1:
        raise AssertionError(f"no completion: {out}")
    return (f"--tp {opts.tp}: {usage.prompt_tokens} prompt + {usage.completion_tokens} "
            f"completion tokens, stopped in {stopped:.1f} s")


RUNNERS: dict[str, Callable[[argparse.Namespace], str]] = {
    "gpu_tests": check_gpu_tests,
    "parity_tiny": check_parity_tiny,
    "parity_7b": check_parity_7b,
    "serve": check_serve,
}


# ---------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    """Device and versions, as far as this machine has them."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    env["cuda"] = torch.version.cuda
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(visible_gpus())]
    for name in ("triton", "transformers", "flashinfer"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as missing
            env[name] = None
    return env


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def write_report(path: Path, env: dict[str, Any], results: list[CheckResult], note: str) -> None:
    report = {"environment": env, "ok": bool(results) and all(r.ok for r in results),
              "note": note, "checks": [asdict(r) for r in results]}
    path.write_text(json.dumps(report, indent=2))


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "result", "seconds", "detail")]
    for r in results:
        first = r.detail.strip().splitlines()[0] if r.detail.strip() else ""
        rows.append((r.name, "PASS" if r.ok else "FAIL", f"{r.seconds:.1f}", first[:100]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    p.add_argument("--json", default="gpu_check.json", help="where the report goes")
    p.add_argument("--tp", type=int, default=None, help="serve check's --tp (default: all GPUs)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--image-size", type=int, default=224, help="side of the test images (px)")
    p.add_argument("--margin-7b", type=float, default=0.02,
                   help="7B: the widest near tie (nats) at which the backends may part")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for pytest / start-up")
    p.add_argument("--scratch", default=None, help="folder for the 7B checkpoint (~16 GB)")
    p.add_argument("--model-7b", default=None, help="a 7B-shaped checkpoint to use, not write")
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown or not args.checks:
        p.error(f"--checks: unknown {unknown}; choose from {', '.join(CHECKS)}")
    if (args.tp is not None and args.tp < 1) or args.new_tokens < 1:
        p.error("--tp and --new-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    env, report = environment(), Path(opts.json)
    if not visible_gpus():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        note = (f"no CUDA device is visible (torch {torch.__version__}, {build}): run "
                "gpu_check on a GPU node; nothing was checked")
        write_report(report, env, [], note)
        print(f"gpu_check: {note}", file=sys.stderr)
        return 2
    opts.tp, opts.device = opts.tp or visible_gpus(), "cuda"
    results = []
    for name in opts.checks:
        results.append(run_check(name, lambda name=name: RUNNERS[name](opts)))
        print(format_table(results[-1:]).splitlines()[1], flush=True)
    write_report(report, env, results, f"{len(env['gpus'])} GPU(s): {', '.join(env['gpus'])}")
    print(format_table(results))
    print(f"report: {report}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
