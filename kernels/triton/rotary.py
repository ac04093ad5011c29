"""Triton rotary embedding (neox layout: first half / second half of each head).

cos/sin are per token, [tokens, head_dim], as built by kernels.rotary.mrope_cos_sin, so the same
kernels serve plain RoPE and MRoPE. One program handles one token: all of its heads. Math in
float32, results in the input's dtype, written to new tensors.

`rotary_store_kv` is the decoder's step in one launch: q and k rotated, and the rotated k and
the v written into the layer's KV pool buffers at the step's slots. On an H200 at Qwen2.5-VL-7B's
shapes a batch-1 decode step ran the two rotary kernels (1.9 + 1.0 us) and two index-put kernels
for the pool (2.9 + 2.8 us) per layer, each with a launch gap after it inside the CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr, stride_xh, num_heads, cos1, cos2, sin1, sin2, offs_d, d_mask, half,
    BLOCK_H: tl.constexpr,
):
    """The two rotated halves, in float32, of the heads at x_ptr (one token's), and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    x_base = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    return out1, out2, offs_h, mask


@triton.jit
def _angles(cos_ptr, sin_ptr, token, stride_ct, stride_st, half, BLOCK_HALF: tl.constexpr):
    """One token's angles, in float32: the cos and sin of each half, their offsets and mask."""
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    cos1 = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + half + offs_d, mask=d_mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_st + half + offs_d, mask=d_mask, other=0.0)
    return cos1, cos2.to(tl.float32), sin1, sin2.to(tl.float32), offs_d, d_mask


@triton.jit
def _store_halves(out_ptr, stride_oh, offs_h, offs_d, out1, out2, mask, half):
    o_base = out_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_base, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st, num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2, offs_d, d_mask = _angles(cos_ptr, sin_ptr, token, stride_ct,
                                                     stride_st, half, BLOCK_HALF)
    out1, out2, offs_h, mask = _rotate(x_ptr + token * stride_xt, stride_xh, num_heads,
                                       cos1, cos2, sin1, sin2, offs_d, d_mask, half, BLOCK_H)
    _store_halves(out_ptr + token * stride_ot, stride_oh, offs_h, offs_d, out1, out2, mask, half)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_buf, v_buf, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_ct, stride_st, num_heads, num_kv_heads, half, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cos1, cos2, sin1, sin2, offs_d, d_mask = _angles(cos_ptr, sin_ptr, token, stride_ct,
                                                     stride_st, half, BLOCK_HALF)
    q1, q2, offs_h, mask = _rotate(q_ptr + token * stride_qt, stride_qh, num_heads,
                                   cos1, cos2, sin1, sin2, offs_d, d_mask, half, BLOCK_H)
    _store_halves(q_out_ptr + token * stride_qot, stride_qoh, offs_h, offs_d, q1, q2, mask, half)
    k1, k2, offs_kv, kv_mask = _rotate(k_ptr + token * stride_kt, stride_kh, num_kv_heads,
                                       cos1, cos2, sin1, sin2, offs_d, d_mask, half, BLOCK_KV)
    # the pool gets k as the unfused path stores it: rounded to k's dtype, then to the pool's
    k1 = k1.to(k_out_ptr.dtype.element_ty)
    k2 = k2.to(k_out_ptr.dtype.element_ty)
    _store_halves(k_out_ptr + token * stride_kot, stride_koh, offs_kv, offs_d, k1, k2, kv_mask,
                  half)
    _store_halves(k_buf + slot * stride_kbt, stride_kbh, offs_kv, offs_d, k1, k2, kv_mask, half)
    offs_full = tl.arange(0, BLOCK_D)
    v_mask = (offs_kv < num_kv_heads)[:, None] & (offs_full < head_dim)[None, :]
    v = tl.load(v_ptr + token * stride_vt + offs_kv[:, None] * stride_vh + offs_full[None, :],
                mask=v_mask, other=0.0)
    v_dst = v_buf + slot * stride_vbt + offs_kv[:, None] * stride_vbh + offs_full[None, :]
    tl.store(v_dst, v.to(v_buf.dtype.element_ty), mask=v_mask)


def _check_angles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, _, head_dim = x.shape
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError("need an even head_dim and cos/sin of shape [tokens, head_dim]")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]. Same result as
    kernels.rotary.apply_rotary."""
    _check_angles(x, cos, sin)
    tokens, heads, head_dim = x.shape
    x = _rows(x)
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


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_qk(q, k, cos, sin)`, and the rotated k and v ([tokens, kv_heads, head_dim])
    written at rows `slots` of the pool buffers k_buf / v_buf ([pool rows, kv_heads, head_dim],
    cast to their dtype), as `KVPool.set_kv` writes them; one launch. Returns the rotated q, k."""
    _check_angles(q, cos, sin)
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [tokens, kv_heads, "
                         f"{head_dim}] for q {tuple(q.shape)}")
    if k_buf.shape[1:] != k.shape[1:] or v_buf.shape != k_buf.shape or slots.shape != (tokens,):
        raise ValueError("the pool buffers must be [rows, kv_heads, head_dim], one slot a token")
    q, k, v = _rows(q), _rows(k), _rows(v)
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.to(q.device, non_blocking=True)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_store_kernel[(tokens,)](
        q, k, v, cos, sin, q_out, k_out, k_buf, v_buf, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        cos.stride(0), sin.stride(0), heads, kv_heads, half, head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return q_out, k_out
