"""Triton rotary embedding (neox layout: first half / second half of each head).

cos/sin are per token, [tokens, head_dim], as built by kernels.rotary.mrope_cos_sin, so the same
kernel serves plain RoPE and MRoPE. One program handles one token: all of its heads of x.
Math in float32, result in x's dtype, written to a new tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st, num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    cos1 = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + half + offs_d, mask=d_mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_st + half + offs_d, mask=d_mask, other=0.0)
    cos2 = cos2.to(tl.float32)
    sin2 = sin2.to(tl.float32)
    x_base = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    o_base = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_base, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]. Same result as
    kernels.rotary.apply_rotary."""
    tokens, heads, head_dim = x.shape
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError("need an even head_dim and cos/sin of shape [tokens, head_dim]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        x, cos, sin, out,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        heads, half,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] by the same angles."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
