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
  that is a near tie in both (--margin-7b nats);
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


def greedy_tokens(
    model_path: str, backend: str, opts: argparse.Namespace, dtype: str = "auto"
) -> list[Greedy]:
    """Greedy tokens of two image prompts through the real scheduler on one device."""
    from bench_offline import make_prompts, parse_args, run_tessera, server_args

    from runtime.distributed import TPGroup
    from runtime.sampler import SamplingParams
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
        out = run_tessera(scheduler, prompts, opts.device)
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
    model_path: str, margin: float | None, opts: argparse.Namespace, dtype: str = "auto"
) -> str:
    """torch vs Triton greedy tokens of two prompts. margin None: every token must agree.
    Else the tokens must agree up to a first difference, if any, that is a near tie in both
    engines: each found its own token more likely than the other's by at most `margin` nats
    (28 layers of float32 summed in other orders can swap two tokens that close)."""
    ref = greedy_tokens(model_path, "torch", opts, dtype)
    ours = greedy_tokens(model_path, "triton", opts, dtype)
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
    if len(ref) != len(ours) or not (exact or near_ties):
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
        return "7b float32: " + compare_backends(folder, opts.margin_7b, opts, "float32")


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
