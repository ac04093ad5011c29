"""The kernels a model uses besides paged attention, chosen once by backend name.

A model takes one `KernelOps` at construction and hands it to its layers, so the choice is
explicit (no global switch) and the torch references stay the default. The Triton set is imported
only when asked for; on a machine without CUDA it runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import activation, norm, rotary
from kernels.attention.varlen import VarlenAttention, varlen_attention

Tensor = torch.Tensor


@dataclass(frozen=True)
class KernelOps:
    name: str
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # (q, k, cos, sin) -> rotated (q, k); q/k: [tokens, heads, head_dim], cos/sin: [tokens, dim]
    apply_rotary_qk: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    varlen_attention: VarlenAttention  # the vision towers' segment attention
    # x [..., 2 * hidden] holding [gate | up] -> silu(gate) * up
    silu_and_mul: Callable[[Tensor], Tensor] = activation.silu_and_mul
    # (q, k, v, cos, sin, k_buf, v_buf, slots) -> rotated (q, k), the rotated k and v written at
    # `slots` of one layer's pool buffers in the same launch; None: rotate, then the attention
    # backend stores (the torch set: on a CPU the two are not separate kernels worth fusing)
    rotary_store_kv: Callable[..., tuple[Tensor, Tensor]] | None = None


TORCH_OPS = KernelOps(
    name="torch",
    rms_norm=norm.rms_norm,
    fused_add_rms_norm=norm.fused_add_rms_norm,
    apply_rotary_qk=rotary.apply_rotary_qk,
    varlen_attention=varlen_attention,
)


def get_kernel_ops(name: str) -> KernelOps:
    """The kernel set for an attention-backend name (as `--attention-backend`)."""
    if name in ("torch", "auto"):
        return TORCH_OPS
    if name in ("triton", "flashinfer"):  # FlashInfer's decoder attention, Triton's others
        from kernels.triton import activation as triton_activation
        from kernels.triton import norm as triton_norm
        from kernels.triton import rotary as triton_rotary

        # The vision towers' segment attention stays on torch's scaled_dot_product_attention
        # (equal-length segments batched, its fused kernels): on an H100 in bfloat16 at
        # Qwen2.5-VL-7B's tower shapes it ran 1.6x faster than the Triton segment kernel over
        # 64-patch windows and 6.8x over 1024-patch frames (scripts/bench_offline.py
        # --varlen-attention, docs/benchmarks.md). The Triton kernel stays for
        # `triton_ops_with_varlen`.
        return KernelOps(
            name="triton",
            rms_norm=triton_norm.rms_norm,
            fused_add_rms_norm=triton_norm.fused_add_rms_norm,
            apply_rotary_qk=triton_rotary.apply_rotary_qk,
            varlen_attention=varlen_attention,
            silu_and_mul=triton_activation.silu_and_mul,
            rotary_store_kv=triton_rotary.rotary_store_kv,
        )
    raise ValueError(f"unknown attention backend {name!r}")


def triton_ops_with_varlen() -> KernelOps:
    """The Triton set with the Triton segment kernel in the vision towers too (for comparing
    the two on a GPU, and for the kernel's own model tests)."""
    from kernels.triton.varlen_attention import varlen_attention as triton_varlen

    return dataclasses.replace(get_kernel_ops("triton"), varlen_attention=triton_varlen)
