"""Triton variable-length attention for the vision towers.

The vision tower attends bidirectionally inside segments given by `cu_seqlens`: one segment per
frame (Qwen2-VL, and Qwen2.5-VL's full-attention blocks) or per window (Qwen2.5-VL's other
blocks). One program handles BLOCK_M query rows of one segment and one head, and walks the keys of
that segment only, with an online softmax in float32 (running max and sum, rescaled per key
block). No segment is padded to the longest one, and no [segments, length, length] score tensor
is ever built, so a batch of images of mixed sizes costs one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.varlen import Segments, as_segments
from kernels.triton.attention import (
    LOG2E,
    NEG_BIG,
    dot_precision,
    head_block,
    online_softmax_block,
)


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    start = tl.load(cu_seqlens + segment)
    length = tl.load(cu_seqlens + segment + 1) - start
    if block_m * BLOCK_M >= length:
        return

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < length
    d_mask = offs_d < head_dim
    q_rows = (start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        kv_pos = n0 + offs_n
        n_mask = kv_pos < length
        kv_rows = (start + kv_pos).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = k_ptr + kv_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v_ptrs = v_ptr + kv_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        visible = n_mask[None, :]
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Segments,
    scale: float,
    block_m: int = 32,
    block_n: int = 32,
) -> torch.Tensor:
    """Bidirectional attention inside each segment of `cu_seqlens`; q/k/v: [N, heads, head_dim].

    q, k and v may be strided views (for example the three parts of a merged QKV output); only
    the last dimension must be contiguous. Given `Segments` (prepared once per encoder call), a
    launch reads nothing from the device and copies nothing to it.
    """
    if q.shape != k.shape or q.shape != v.shape:
        shapes = [tuple(x.shape) for x in (q, k, v)]
        raise ValueError(f"q, k and v shapes differ: {shapes}")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v need a contiguous last dimension")
    tokens, heads, head_dim = q.shape
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    segments = as_segments(cu_seqlens, q.device)
    if tokens == 0 or segments.count <= 0:
        return out
    if segments.tokens != tokens:
        raise ValueError(f"cu_seqlens ends at {segments.tokens} but there are {tokens} tokens")
    grid = (segments.count, heads, triton.cdiv(max(segments.max_len, 1), block_m))
    _varlen_kernel[grid](
        q, k, v, out, segments.device_bounds,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale * LOG2E, head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_block(head_dim),
        PRECISION=dot_precision(q.dtype),
    )
    return out
