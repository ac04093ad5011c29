"""The kernels a model uses besides paged attention, chosen once by backend name.

A model takes one `KernelOps` at construction and hands it to its layers, so the choice is
explicit (no global switch) and the torch references stay the default. The Triton set is imported
only when asked for; on a machine without CUDA it runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import norm, rotary
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
        from kernels.triton import norm as triton_norm
        from kernels.triton import rotary as triton_rotary
        from kernels.triton.varlen_attention import varlen_attention as triton_varlen

        return KernelOps(
            name="triton",
            rms_norm=triton_norm.rms_norm,
            fused_add_rms_norm=triton_norm.fused_add_rms_norm,
            apply_rotary_qk=triton_rotary.apply_rotary_qk,
            varlen_attention=triton_varlen,
        )
    raise ValueError(f"unknown attention backend {name!r}")
