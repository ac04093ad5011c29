"""Triton attention over tessera's token-indexed KV pool.

Both kernels read K/V straight from the pool buffers ([slots + 1, kv_heads, head_dim] per layer):
the slot of a request's j-th token is `req_to_token[req_pool_index, j]`. No K/V is gathered into a
contiguous copy first. Scores and the running softmax are kept in float32 (online softmax: a
running max and running sum per query row, rescaled as each block of keys arrives), and every load
is upcast to float32 so bf16 pools work in the interpreter too.

- extend: the new tokens of each request attend to its cached prefix and, causally, to each other.
  Their K/V are written to the pool first, so one loop over the request's slots covers both parts.
- decode: one new token per request attends to all of its tokens; the q heads that share a kv head
  are handled together (padded to 16 rows for tl.dot), so each K/V block is loaded once per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.attention.base import AttentionLayer, store_kv

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch

LOG2E = 1.4426950408889634
# Start value of the running max: finite, so a fully masked block gives no NaN. A tl.constexpr,
# because compiled (not interpreted) @triton.jit code may read no other kind of global.
NEG_BIG = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-request device tensors (int32), built once per model forward and shared by all layers."""

    q_starts: torch.Tensor  # offset of each request's first new token in q / out
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    max_extend_len: int

    @staticmethod
    def from_batch(batch: ForwardBatch, device: torch.device) -> AttentionMetadata:
        if batch.decode_tables is not None:
            return AttentionMetadata.from_tables(batch)
        extend = batch.extend_lens_list
        starts = [0]
        for n in extend[:-1]:
            starts.append(starts[-1] + n)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return AttentionMetadata(
            q_starts=as_tensor(starts),
            prefix_lens=as_tensor(batch.prefix_lens_list),
            extend_lens=as_tensor(extend),
            seq_lens=as_tensor(batch.seq_lens_list),
            req_pool_indices=as_tensor(batch.req_pool_indices_list),
            max_extend_len=max(extend, default=0),
        )


    @staticmethod
    def from_tables(batch: ForwardBatch) -> AttentionMetadata:
        """A static decode's metadata, from its device tables alone (no host value read)."""
        tables = batch.decode_tables
        assert tables is not None
        rows, lens = tables.req_pool_indices.int(), tables.seq_lens.int()
        ones = torch.ones_like(lens)
        starts = torch.arange(lens.numel(), dtype=torch.int32, device=lens.device)
        return AttentionMetadata(starts, lens - 1, ones, lens, rows, max_extend_len=1)


@triton.jit
def online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one block of keys/values into the running (max, sum, weighted values) of q's rows.

    q: [M, D], k and v: [N, D], visible: a mask broadcastable to [M, N]; m_i, l_i: [M];
    acc: [M, D]. qk_scale includes log2(e), so exp2 gives the softmax weights."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def load_pool_kv(
    k_buf, v_buf, token_slots, kv_pos, n_mask, kv_head, offs_d, d_mask,
    stride_kt, stride_kh, stride_vt, stride_vh,
):
    """K and V ([N, D], float32) of one kv head at a request's token positions `kv_pos`, read
    from the pool at the slots its req_to_token row (`token_slots`) names."""
    slots = tl.load(token_slots + kv_pos, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_ptrs = k_buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    v_ptrs = v_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _extend_kernel(
    q_ptr, out_ptr, k_buf, v_buf, req_to_token,
    q_starts, prefix_lens, extend_lens, req_pool_indices,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, qk_scale, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    extend_len = tl.load(extend_lens + req)
    if block_m * BLOCK_M >= extend_len:
        return
    q_start = tl.load(q_starts + req)
    prefix_len = tl.load(prefix_lens + req)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    seq_len = prefix_len + extend_len
    kv_head = head // GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < head_dim
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q_pos = prefix_len + offs_m  # position of each query row within its request

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, prefix_len + (block_m + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        kv_pos = n0 + offs_n
        n_mask = kv_pos < kv_end
        k, v = load_pool_kv(
            k_buf, v_buf, req_to_token + row * stride_req, kv_pos, n_mask, kv_head, offs_d,
            d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
        )
        visible = (q_pos[:, None] >= kv_pos[None, :]) & n_mask[None, :]
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, out_ptr, k_buf, v_buf, req_to_token,
    seq_lens, req_pool_indices,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, qk_scale, head_dim,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + req)
    row = tl.load(req_pool_indices + req).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < head_dim
    heads = kv_head * GROUP + offs_h  # the q heads that read this kv head
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        kv_pos = n0 + offs_n
        n_mask = kv_pos < seq_len
        k, v = load_pool_kv(
            k_buf, v_buf, req_to_token + row * stride_req, kv_pos, n_mask, kv_head, offs_d,
            d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
        )
        visible = n_mask[None, :]  # [1, BLOCK_N], broadcast over the group's heads
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def head_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16


def group_block(group: int) -> int:
    """Rows of the decode kernel's q tile: the q heads of one kv head, padded for tl.dot."""
    return max(16, triton.next_power_of_2(group))


def dot_precision(kv_dtype: torch.dtype) -> str:
    """Exact float32 dots for a float32 pool; tf32 otherwise (bf16/fp16 values fit in tf32)."""
    return "ieee" if kv_dtype == torch.float32 else "tf32"


def _check_pool(k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor) -> None:
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("KV buffers and req_to_token need a contiguous last dimension")


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    block_m: int = 32,
    block_n: int = 32,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] (new tokens of all requests, in order) -> same shape.

    The new tokens' K/V must already be in the pool at their slots.
    """
    _check_pool(k_buf, v_buf, req_to_token)
    tokens, heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_reqs = meta.q_starts.numel()
    if tokens == 0 or num_reqs == 0:
        return out
    grid = (num_reqs, heads, triton.cdiv(meta.max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buf, v_buf, req_to_token,
        meta.q_starts, meta.prefix_lens, meta.extend_lens, meta.req_pool_indices,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), scaling * LOG2E, head_dim,
        GROUP=heads // k_buf.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=head_block(head_dim), PRECISION=dot_precision(k_buf.dtype),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    scaling: float,
    block_n: int = 64,
) -> torch.Tensor:
    """q: [requests, heads, head_dim], one new token per request (already in the pool)."""
    _check_pool(k_buf, v_buf, req_to_token)
    num_reqs, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    _decode_kernel[(num_reqs, kv_heads)](
        q, out, k_buf, v_buf, req_to_token,
        seq_lens, req_pool_indices,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), scaling * LOG2E, head_dim,
        GROUP=group, BLOCK_H=group_block(group), BLOCK_N=block_n,
        BLOCK_D=head_block(head_dim), PRECISION=dot_precision(k_buf.dtype),
    )
    return out


class TritonAttentionBackend:
    """The AttentionBackend protocol on the two kernels above."""

    def __init__(self, block_m: int = 32, block_n: int = 32) -> None:
        self.block_m = block_m
        self.block_n = block_n
        self._meta_batch: ForwardBatch | None = None
        self._meta: AttentionMetadata | None = None

    def metadata(self, batch: ForwardBatch, device: torch.device) -> AttentionMetadata:
        """Build the per-request tensors on the first layer of a forward; reuse them after."""
        if self._meta is None or self._meta_batch is not batch:
            self._meta = AttentionMetadata.from_batch(batch, device)
            self._meta_batch = batch
        return self._meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        k_buf, v_buf = store_kv(k, v, layer, batch)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        meta = self.metadata(batch, q.device)
        if batch.is_decode:
            out = decode_attention(
                q, k_buf, v_buf, batch.req_to_token, meta.seq_lens, meta.req_pool_indices,
                layer.scaling, self.block_n,
            )
        else:
            out = extend_attention(
                q, k_buf, v_buf, batch.req_to_token, meta, layer.scaling,
                self.block_m, self.block_n,
            )
        return out.view(-1, layer.num_heads * layer.head_dim)
