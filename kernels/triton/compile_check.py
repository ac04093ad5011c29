"""Compile every Triton kernel for real GPU targets without a GPU (and without launching).

Each `KernelSpec` is one specialisation a launcher in this package picks for a model tessera
serves: the element type of the tensors, the block sizes and head dimensions the launchers derive
(`head_block`, `group_block`, `dot_precision`, next powers of two) for the Qwen2-VL,
Qwen2.5-VL and Qwen3-VL shapes, and the attention kernels' sliding-window and item-span variants
(their constexpr switches) at the shapes of the decoders that have local layers (Gemma 3).
`compile_all` drives each one through `triton.compile` on an `ASTSource` for a `GPUTarget` (sm_80
and sm_90 by default) down to PTX and, since the Triton wheel ships ptxas, a cubin.

The kernels must be real `JITFunction`s, so this runs in a process where TRITON_INTERPRET is not
set when triton is first imported: `scripts/compile_kernels.py` (the CI test starts it in a clean
subprocess with a fresh TRITON_CACHE_DIR, since a cached binary skips the compile).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import triton

TARGETS = (80, 90)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The element types compiled for a target, where not every one: float32 dots are exact ("ieee")
# and lower to the same FMA loops on both architectures (no tensor-core path), so sm_90 alone
# checks them, and sm_80 (an A100 serves bf16 or fp16) takes the types whose dots differ by
# target. float32 costs as much to compile as the other two together.
TARGET_TYPES = {80: ("bf16", "fp16")}

# (heads, kv_heads, head_dim) of the decoders: Qwen2/2.5-VL-7B (28, 4, 128) and the tiny test
# checkpoints. Qwen2-VL-2B (12, 2) and Qwen3-VL-8B (32, 8) share head_dim 128; the group size
# is a constexpr that only changes masks, so the 7B's stands for theirs.
LLM_SHAPES = ((28, 4, 128), (4, 2, 16))
# (heads, kv_heads, head_dim) of decoders with sliding-window layers and bidirectional image
# items: Gemma 3 4B (8, 4, 256; 12B's (16, 8) gives the same constexprs). Their kernels compile
# with and without each mask (the masks' code is the same at every shape, and the CPU tests run
# it at the tiny checkpoints' shapes).
MASKED_SHAPES = ((8, 4, 256),)
# (heads, head_dim) of the vision towers: Qwen2-VL / Qwen2.5-VL (1280 / 16), Qwen3-VL (1152 / 16),
# the tiny checkpoints
VIT_SHAPES = ((16, 80), (16, 72), (2, 16))
# RMSNorm widths: decoder hidden sizes (2B, 7B, 8B) and the Qwen2.5-VL tower's
NORM_WIDTHS = (1536, 3584, 4096, 1280)
ATTN_BLOCK = 32  # TritonAttentionBackend's and varlen_attention's default block_m / block_n


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation of one kernel: argument types by name and the constexpr values.

    Pointer arguments are marked 16-byte aligned, as a launch on torch tensors specialises them.
    """

    kernel: str  # attribute name in its module
    module: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]

    @property
    def element_type(self) -> str:
        """The type of its first pointer argument (the tensors' dtype), e.g. "bf16"."""
        return next(t[1:] for _, t in self.signature if t.startswith("*"))

    def source(self) -> object:
        import importlib

        from triton.compiler import ASTSource

        fn = getattr(importlib.import_module(self.module), self.kernel)
        types = dict(self.signature)
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(fn.arg_names)
            if signature[name].startswith("*")
        }
        return ASTSource(fn, signature, dict(self.constexprs), aligned)


def spec(kernel: str, module: str, signature: dict[str, str], **constexprs: object) -> KernelSpec:
    return KernelSpec(kernel, module, tuple(signature.items()), tuple(sorted(constexprs.items())))


def _ptrs(names: str, ty: str) -> dict[str, str]:
    return {name: f"*{ty}" for name in names.split()}


def _ints(names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), "i32")


def attention_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """The paged extend and decode kernels as TritonAttentionBackend launches them: the decode
    in one pass, or in splits and their merge (the split count is an int argument, the merge's
    BLOCK_S its next power of two, at most MAX_DECODE_SPLITS)."""
    from kernels.triton.attention import (
        MAX_DECODE_SPLITS,
        dot_precision,
        group_block,
        head_block,
    )

    ty = TRITON_TYPES[dtype]
    strides = "stride_qt stride_qh stride_ot stride_oh stride_kt stride_kh stride_vt stride_vh"
    common = {
        **_ptrs("q_ptr out_ptr k_buf v_buf", ty),
        "req_to_token": "*i64",
        **_ints(f"{strides} stride_req head_dim window"),
        "qk_scale": "fp32",
    }
    extend = {
        **common,
        **_ptrs("q_starts prefix_lens extend_lens req_pool_indices item_spans", "i32"),
        **_ints("span_rows"),
    }
    decode = {**common, **_ptrs("seq_lens req_pool_indices", "i32")}
    split = {
        **decode,
        **_ptrs("acc_part stat_part", "fp32"),
        **_ints("num_heads num_splits"),
    }
    merge = {  # out_ptr first: `describe` names a spec's dtype by its first argument
        **_ptrs("out_ptr", ty),
        **_ptrs("acc_part stat_part", "fp32"),
        **_ints("stride_ot stride_oh head_dim num_heads num_splits"),
    }
    module = "kernels.triton.attention"
    plain = [(shape, False, False) for shape in LLM_SHAPES]
    switches = ((False, False), (True, False), (False, True), (True, True))
    masked = [(shape, *pair) for shape in MASKED_SHAPES for pair in switches]
    for (heads, kv_heads, head_dim), windowed, spans in [*plain, *masked]:
        group = heads // kv_heads
        blocks = {"GROUP": group, "BLOCK_N": ATTN_BLOCK, "BLOCK_D": head_block(head_dim)}
        blocks["PRECISION"] = dot_precision(dtype)
        blocks["WINDOWED"] = windowed
        yield spec("_extend_kernel", module, extend, BLOCK_M=ATTN_BLOCK, HAS_SPANS=spans, **blocks)
        if spans:
            continue  # a decode has no spans
        yield spec("_decode_kernel", module, decode, BLOCK_H=group_block(group), **blocks)
        yield spec("_decode_split_kernel", module, split, BLOCK_H=group_block(group), **blocks)
        for splits in (2, MAX_DECODE_SPLITS):
            yield spec(
                "_decode_merge_kernel", module, merge,
                BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=blocks["BLOCK_D"],
            )


def varlen_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """The vision towers' segment attention as varlen_attention launches it."""
    from kernels.triton.attention import dot_precision, head_block

    ty = TRITON_TYPES[dtype]
    strides = "stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ot stride_oh"
    signature = {
        **_ptrs("q_ptr k_ptr v_ptr out_ptr", ty),
        "cu_seqlens": "*i32",
        **_ints(f"{strides} head_dim"),
        "qk_scale": "fp32",
    }
    for _, head_dim in VIT_SHAPES:
        yield spec(
            "_varlen_kernel", "kernels.triton.varlen_attention", signature,
            BLOCK_M=ATTN_BLOCK, BLOCK_N=ATTN_BLOCK, BLOCK_D=head_block(head_dim),
            PRECISION=dot_precision(dtype),
        )


def norm_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """RMSNorm, plain and with the fused residual add, at the served hidden sizes."""
    signature = {
        **_ptrs("x_ptr res_ptr w_ptr out_ptr res_out_ptr", TRITON_TYPES[dtype]),
        **_ints("stride_x stride_r stride_o stride_ro hidden"),
        "eps": "fp32",
    }
    for width in NORM_WIDTHS:
        for residual in (False, True):
            yield spec(
                "_rms_norm_kernel", "kernels.triton.norm", signature,
                HAS_RESIDUAL=residual, BLOCK=triton.next_power_of_2(width),
            )


def rotary_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """Rotary on q and k of the decoders and the vision towers (cos/sin tables in float32)."""
    signature = {
        **_ptrs("x_ptr out_ptr", TRITON_TYPES[dtype]),
        **_ptrs("cos_ptr sin_ptr", "fp32"),
        **_ints("stride_xt stride_xh stride_ot stride_oh stride_ct stride_st num_heads half"),
    }
    llm = [(h, d) for heads, kv, d in LLM_SHAPES for h in (heads, kv)]
    for num_heads, head_dim in [*llm, *VIT_SHAPES]:
        yield spec(
            "_rotary_kernel", "kernels.triton.rotary", signature,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )


def rotary_store_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """The decoders' fused rotary and KV store, into a pool of the same dtype (slots int64)."""
    ty = TRITON_TYPES[dtype]
    strides = (
        "stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_qot stride_qoh "
        "stride_kot stride_koh stride_kbt stride_kbh stride_vbt stride_vbh stride_ct stride_st"
    )
    signature = {
        **_ptrs("q_ptr k_ptr v_ptr", ty),
        **_ptrs("cos_ptr sin_ptr", "fp32"),
        **_ptrs("q_out_ptr k_out_ptr k_buf v_buf", ty),
        "slots_ptr": "*i64",
        **_ints(f"{strides} num_heads num_kv_heads half head_dim"),
    }
    for heads, kv_heads, head_dim in LLM_SHAPES:
        yield spec(
            "_rotary_store_kernel", "kernels.triton.rotary", signature,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )


def activation_specs(dtype: torch.dtype) -> Iterator[KernelSpec]:
    """silu(gate) * up (one block size for every width)."""
    from kernels.triton.activation import BLOCK

    signature = {**_ptrs("x_ptr out_ptr", TRITON_TYPES[dtype]), **_ints("stride_x stride_o hidden")}
    yield spec("_silu_and_mul_kernel", "kernels.triton.activation", signature, BLOCK=BLOCK)


def all_specs(dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[KernelSpec]:
    """Every distinct specialisation the launchers pick for the served models, per dtype (shapes
    that give the same constexprs, such as head_dim 72 and 80, compile once)."""
    makers = (
        attention_specs, varlen_specs, norm_specs, rotary_specs, rotary_store_specs,
        activation_specs,
    )
    found = (one for dtype in dtypes for make in makers for one in make(dtype))
    return list(dict.fromkeys(found))


def describe(spec: KernelSpec) -> str:
    """e.g. `_decode_kernel q_ptr=*bf16 GROUP=7 BLOCK_D=128 ...`"""
    first = dict(spec.signature)
    head = next(iter(first.items()))
    consts = " ".join(f"{k}={v}" for k, v in spec.constexprs)
    return f"{spec.kernel} {head[0]}={head[1]} {consts}"


@dataclass
class CompileResult:
    spec: str  # describe(spec)
    arch: int
    ok: bool
    seconds: float
    error: str = ""
    asm: list[str] = field(default_factory=list)  # the stages produced: ttir ... ptx, cubin


def compile_one(spec: KernelSpec, arch: int) -> CompileResult:
    """Compile one spec for sm_<arch> down to PTX (and a cubin); a compiler error is a result."""
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    try:
        kernel = triton.compile(spec.source(), target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # noqa: BLE001 - every compiler failure is reported, not raised
        error = f"{type(exc).__name__}: {exc}".strip()[-2000:]
        return CompileResult(describe(spec), arch, False, _since(start), error)
    asm = sorted(kernel.asm)
    ok = bool(kernel.asm.get("ptx"))
    return CompileResult(describe(spec), arch, ok, _since(start), "" if ok else "no PTX", asm)


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def compile_all(specs: list[KernelSpec], targets: tuple[int, ...] = TARGETS) -> list[CompileResult]:
    """Every spec for every target that takes its element type (`TARGET_TYPES`). Refuses to run
    under the interpreter, where the kernels are not JITFunctions and nothing would be compiled."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels would not be compiled")
    return [
        compile_one(spec, arch)
        for spec in specs
        for arch in targets
        if spec.element_type in TARGET_TYPES.get(arch, (spec.element_type,))
    ]
