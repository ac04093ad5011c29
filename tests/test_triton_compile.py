"""Every Triton kernel compiles for sm_80 and sm_90 with the real compiler, no GPU needed
(float32 for sm_90 only: see compile_check.TARGET_TYPES).

The interpreter (TRITON_INTERPRET=1, set by conftest on CPU machines) accepts code the compiler
refuses, such as a @triton.jit function reading a plain module global. So the compile runs in
a subprocess whose environment has no TRITON_INTERPRET, with an empty TRITON_CACHE_DIR (a cached
binary would skip the compile). Nothing is launched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# every launched kernel in kernels/triton (the `@triton.jit` functions named `_..._kernel`; the
# others are device functions they call), read from the source so that a new kernel without a
# compile spec fails the test below
KERNELS = {
    match
    for path in (ROOT / "kernels" / "triton").glob("*.py")
    for match in re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", path.read_text())
}


def compiler_env(cache: Path, *paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*paths, ROOT))
    return env


def run_python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path: Path) -> None:
    # one compiler process per target, side by side (each with a cache of its own): the
    # compiles are single-threaded, so two take the time of one on a 2-core machine
    procs = {}
    for arch in (80, 90):
        report = tmp_path / f"compile-{arch}.json"
        cmd = ["scripts/compile_kernels.py", "--arch", str(arch), "--json", str(report)]
        env = compiler_env(tmp_path / f"cache-{arch}")
        procs[report] = subprocess.Popen(
            [sys.executable, *cmd], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
    results = []
    for report, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        results += json.loads(report.read_text())
    assert all(r["ok"] and "ptx" in r["asm"] for r in results)
    assert {r["spec"].split()[0] for r in results} == KERNELS
    for arch, types in ((80, ("bf16", "fp16")), (90, ("fp32", "bf16", "fp16"))):
        specs = {r["spec"] for r in results if r["arch"] == arch}
        for ty in types:
            assert {s.split()[0] for s in specs if f"=*{ty} " in s} == KERNELS, (arch, ty)
        assert all(any(f"=*{ty} " in s for ty in types) for s in specs), arch
    # the 7B decoder's head_dim 128 and the vision towers' 80 (BLOCK_D 128) are among them
    assert any("_decode_kernel" in s and "BLOCK_D=128" in s for s in specs)
    assert any("_decode_split_kernel" in s and "BLOCK_D=128" in s for s in specs)
    assert any("_varlen_kernel" in s and "BLOCK_D=128" in s for s in specs)
    # Gemma 3's head_dim 256 with its local layers' window and its image items' spans
    for kernel in ("_extend_kernel", "_decode_kernel", "_decode_split_kernel"):
        assert any(kernel in s and "BLOCK_D=256" in s and "WINDOWED=True" in s for s in specs)
    assert any("HAS_SPANS=True" in s and "WINDOWED=True" in s for s in specs)
    assert any("HAS_SPANS=True" in s and "WINDOWED=False" in s for s in specs)
    # ptxas ships with the Triton wheel: a cubin is built too (no device needed)
    assert all("cubin" in r["asm"] for r in results)


BAD_KERNEL = """
import triton
import triton.language as tl

LIMIT = -1.0e30  # a plain global: the interpreter reads it, the compiler refuses it


@triton.jit
def bad_kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], LIMIT, tl.float32))
"""

COMPILE_BAD = """
from kernels.triton.compile_check import compile_all, spec
result, = compile_all([spec("bad_kernel", "bad_kernels", {"out_ptr": "*fp32"}, BLOCK=16)], (90,))
print(result.ok)
print(result.error)
"""


def test_a_kernel_that_does_not_compile_is_reported(tmp_path: Path) -> None:
    """The check fails on the bug the interpreter hides (what the attention kernels had)."""
    (tmp_path / "bad_kernels.py").write_text(textwrap.dedent(BAD_KERNEL))
    proc = run_python(["-c", COMPILE_BAD], compiler_env(tmp_path / "cache", tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ok, error = proc.stdout.split("\n", 1)
    assert ok == "False"
    assert "Cannot access global variable LIMIT" in error


def test_compile_all_refuses_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.triton.compile_check import all_specs, compile_all

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_all(all_specs(), (90,))
