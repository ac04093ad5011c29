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
  A small batch gives too few (request, kv head) programs to fill the GPU, so the tokens are then
  cut into splits: one program per (request, kv head, split) writes its split's running max, sum
  and unnormalised values to float32 scratch, and a second kernel merges the splits per
  (request, q head). The split count is chosen on the host from shapes alone (`decode_splits`),
  since a captured decode step's lengths exist only on the device.

Two masks beyond causal, each behind a constexpr switch so that a plain layer compiles to the
plain kernel: a local layer's sliding window W (a query at position i sees keys j with
i - j < W; the key loop starts at the window's first block, and a decode reads only the last W
tokens), and an extend batch's bidirectional item spans (`AttentionBatch.item_spans`: a token
inside a media item also sees every key of that item, later ones included; the key loop of a
query block then reaches the end of the furthest item in it). The window is a plain int
argument, static per layer, so a captured CUDA graph replays each layer with its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.base import AttentionLayer, store_kv
from kernels.attention.batch_view import AttentionBatch

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
    def from_batch(batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
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
    def from_tables(batch: AttentionBatch) -> AttentionMetadata:
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
    q_starts, prefix_lens, extend_lens, req_pool_indices, item_spans,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, qk_scale, head_dim, window, span_rows,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, WINDOWED: tl.constexpr, HAS_SPANS: tl.constexpr,
):
    """One program per (request, q head, block of BLOCK_M new tokens). With WINDOWED, keys
    more than `window - 1` positions before a query are hidden; with HAS_SPANS, the first
    `span_rows` q rows read their item's [start, end) from item_spans ([span_rows, 2], int32),
    and every key of the item is visible to them."""
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
    kv_start = 0
    kv_end = tl.minimum(seq_len, prefix_len + (block_m + 1) * BLOCK_M)
    if WINDOWED:  # the block's first query sees back to its window's start, the others less
        kv_start = tl.maximum(prefix_len + block_m * BLOCK_M - window + 1, 0)
    if HAS_SPANS:
        span_mask = m_mask & (q_rows < span_rows)
        item_lo = tl.load(item_spans + q_rows * 2, mask=span_mask, other=0)
        item_hi = tl.load(item_spans + q_rows * 2 + 1, mask=span_mask, other=0)
        in_item = item_hi > item_lo
        kv_start = tl.minimum(kv_start, tl.min(tl.where(in_item, item_lo, kv_start), axis=0))
        kv_end = tl.minimum(seq_len, tl.maximum(kv_end, tl.max(item_hi, axis=0)))
    kv_start = kv_start // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        kv_pos = n0 + offs_n
        n_mask = kv_pos < kv_end
        k, v = load_pool_kv(
            k_buf, v_buf, req_to_token + row * stride_req, kv_pos, n_mask, kv_head, offs_d,
            d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
        )
        visible = q_pos[:, None] >= kv_pos[None, :]
        if WINDOWED:
            visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
        if HAS_SPANS:
            inside = (kv_pos[None, :] >= item_lo[:, None]) & (kv_pos[None, :] < item_hi[:, None])
            visible = visible | inside
        visible = visible & n_mask[None, :]
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def load_group_q(
    q_ptr, req, kv_head, stride_qt, stride_qh, offs_d, d_mask,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The q rows ([BLOCK_H, D], float32) of request `req`'s heads that read `kv_head`, their
    head numbers and the mask of the rows that are real heads."""
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    return q, heads, h_mask


@triton.jit
def attend_token_range(
    q, k_buf, v_buf, token_slots, kv_head, start, end, offs_d, d_mask,
    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Running (max, sum, weighted values) of one group's q rows over the request's token
    positions [start, end); an empty range leaves (NEG_BIG, 0, 0)."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        kv_pos = n0 + offs_n
        n_mask = kv_pos < end
        k, v = load_pool_kv(
            k_buf, v_buf, token_slots, kv_pos, n_mask, kv_head, offs_d, d_mask,
            stride_kt, stride_kh, stride_vt, stride_vh,
        )
        visible = n_mask[None, :]  # [1, BLOCK_N], broadcast over the group's heads
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, out_ptr, k_buf, v_buf, req_to_token,
    seq_lens, req_pool_indices,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, qk_scale, head_dim, window,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
):
    """One program per (request, kv head) over all of the request's tokens (its last `window`
    with WINDOWED)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + req)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    start = 0
    if WINDOWED:
        start = tl.maximum(seq_len - window, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q, heads, h_mask = load_group_q(
        q_ptr, req, kv_head, stride_qt, stride_qh, offs_d, d_mask, GROUP, BLOCK_H
    )
    m_i, l_i, acc = attend_token_range(
        q, k_buf, v_buf, req_to_token + row * stride_req, kv_head, start, seq_len, offs_d,
        d_mask,
        stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
        BLOCK_H, BLOCK_N, BLOCK_D, PRECISION,
    )
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, acc_part, stat_part, k_buf, v_buf, req_to_token,
    seq_lens, req_pool_indices,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, qk_scale, head_dim, num_heads, num_splits, window,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
):
    """One program per (request, kv head, split) over the split's tokens. The tokens read are
    [lo, seq_len): lo = 0, or seq_len - window with WINDOWED. Split s covers
    [lo + s * L, lo + (s + 1) * L), L = cdiv(seq_len - lo, num_splits) rounded up to BLOCK_N;
    the last splits of a short request are empty.

    Partial row p = (request * num_heads + q head) * num_splits + split: the unnormalised values
    at acc_part[p, :head_dim] (left unwritten for an empty split), the running max and sum at
    stat_part[p, 0] and stat_part[p, 1] (NEG_BIG and 0 for an empty split)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(seq_len, start + split_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q, heads, h_mask = load_group_q(
        q_ptr, req, kv_head, stride_qt, stride_qh, offs_d, d_mask, GROUP, BLOCK_H
    )
    m_i, l_i, acc = attend_token_range(
        q, k_buf, v_buf, req_to_token + row * stride_req, kv_head, start, end, offs_d, d_mask,
        stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
        BLOCK_H, BLOCK_N, BLOCK_D, PRECISION,
    )
    parts = (req.to(tl.int64) * num_heads + heads) * num_splits + split
    a_ptrs = acc_part + parts[:, None] * head_dim + offs_d[None, :]
    filled = h_mask & (l_i > 0.0)  # rows that saw a token (an empty split writes no values)
    tl.store(a_ptrs, acc, mask=filled[:, None] & d_mask[None, :])
    tl.store(stat_part + parts * 2, m_i, mask=h_mask)
    tl.store(stat_part + parts * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    acc_part, stat_part, out_ptr,
    stride_ot, stride_oh, head_dim, num_heads, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (request, q head): rescale each split's values and sum to the running
    max over all splits, then divide by the rescaled sum of sums. A split without tokens (sum 0)
    gets weight 0 and its unwritten values are not read."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    parts = (req.to(tl.int64) * num_heads + head) * num_splits + offs_s
    m_s = tl.load(stat_part + parts * 2, mask=s_mask, other=NEG_BIG)
    l_s = tl.load(stat_part + parts * 2 + 1, mask=s_mask, other=0.0)
    used = l_s > 0.0
    a_ptrs = acc_part + parts[:, None] * head_dim + offs_d[None, :]
    acc_s = tl.load(a_ptrs, mask=used[:, None] & d_mask[None, :], other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, axis=0))
    out = tl.sum(acc_s * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


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


def window_arg(window: int | None) -> int:
    """A layer's sliding window as the kernels' int argument (0 without one)."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    return window


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    block_m: int = 32,
    block_n: int = 32,
    window: int | None = None,
    item_spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] (new tokens of all requests, in order) -> same shape.

    The new tokens' K/V must already be in the pool at their slots. window: the layer's sliding
    window (None: every earlier key). item_spans: [rows, 2] int32, each of the first `rows`
    tokens' bidirectional item [start, end) in its request (0, 0 outside items); the tokens
    after them (a mixed step's decode tail) have none.
    """
    _check_pool(k_buf, v_buf, req_to_token)
    tokens, heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_reqs = meta.q_starts.numel()
    if tokens == 0 or num_reqs == 0:
        return out
    if item_spans is not None:
        if item_spans.dim() != 2 or item_spans.shape[1] != 2 or item_spans.shape[0] > tokens:
            raise ValueError(f"item_spans must be [<= {tokens}, 2], got {tuple(item_spans.shape)}")
        item_spans = item_spans.to(torch.int32).contiguous()
    spans = meta.q_starts if item_spans is None else item_spans  # a placeholder when unused
    grid = (num_reqs, heads, triton.cdiv(meta.max_extend_len, block_m))
    _extend_kernel[grid](
        q, out, k_buf, v_buf, req_to_token,
        meta.q_starts, meta.prefix_lens, meta.extend_lens, meta.req_pool_indices, spans,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), scaling * LOG2E, head_dim, window_arg(window),
        0 if item_spans is None else item_spans.shape[0],
        GROUP=heads // k_buf.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=head_block(head_dim), PRECISION=dot_precision(k_buf.dtype),
        WINDOWED=window is not None, HAS_SPANS=item_spans is not None,
    )
    return out


# Programs a decode launch aims at (about four per SM of a 132-SM GPU): fewer (request, kv
# head) programs get their tokens cut into splits, at most MAX_DECODE_SPLITS. A batch with half
# as many programs or more runs in one pass: on an H200 (7B shapes, bf16, the backend's 32-token
# blocks) splitting such a batch lost time at a 400-token context, while below that each split
# count chosen here beat one pass at 400, 2000 and 8000 tokens (batch 1: 14.5 -> 5.5 us at
# 400 tokens, 245 -> 13 us at 8000).
DECODE_TARGET_PROGRAMS = 512
MAX_DECODE_SPLITS = 32


def decode_splits(num_reqs: int, kv_heads: int, max_context: int, block_n: int) -> int:
    """Splits per request for a decode of `num_reqs` requests whose lengths are at most
    `max_context`: from host shapes only, so the same launch serves every step a CUDA graph
    replays. Never more splits than blocks of `block_n` tokens in the longest possible
    request."""
    programs = num_reqs * kv_heads
    if 2 * programs >= DECODE_TARGET_PROGRAMS:
        return 1
    wanted = triton.cdiv(DECODE_TARGET_PROGRAMS, programs)
    return max(1, min(wanted, MAX_DECODE_SPLITS, triton.cdiv(max_context, block_n)))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    scaling: float,
    block_n: int = 64,
    num_splits: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q: [requests, heads, head_dim], one new token per request (already in the pool).

    num_splits: token splits per request; None picks `decode_splits` from the shapes (a
    windowed layer reads at most `window` tokens). window: the layer's sliding window."""
    _check_pool(k_buf, v_buf, req_to_token)
    num_reqs, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    kv_heads = k_buf.shape[1]
    if num_splits is None:
        context = req_to_token.shape[1] if window is None else min(window, req_to_token.shape[1])
        num_splits = decode_splits(num_reqs, kv_heads, context, block_n)
    group = heads // kv_heads
    blocks = {
        "GROUP": group, "BLOCK_H": group_block(group), "BLOCK_N": block_n,
        "BLOCK_D": head_block(head_dim), "PRECISION": dot_precision(k_buf.dtype),
        "WINDOWED": window is not None,
    }
    strides = (k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1))
    if num_splits == 1:
        _decode_kernel[(num_reqs, kv_heads)](
            q, out, k_buf, v_buf, req_to_token, seq_lens, req_pool_indices,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
            req_to_token.stride(0), scaling * LOG2E, head_dim, window_arg(window), **blocks,
        )
        return out
    acc_part = torch.empty(num_reqs, heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    stat_part = torch.empty(num_reqs, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_reqs, kv_heads, num_splits)](
        q, acc_part, stat_part, k_buf, v_buf, req_to_token, seq_lens, req_pool_indices,
        q.stride(0), q.stride(1), *strides,
        req_to_token.stride(0), scaling * LOG2E, head_dim, heads, num_splits,
        window_arg(window), **blocks,
    )
    _decode_merge_kernel[(num_reqs, heads)](
        acc_part, stat_part, out, out.stride(0), out.stride(1), head_dim, heads, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=blocks["BLOCK_D"],
    )
    return out


class TritonAttentionBackend:
    """The AttentionBackend protocol on the kernels above: the layer's sliding window in both,
    the batch's item spans in an extend (a decode batch has none)."""

    def __init__(self, block_m: int = 32, block_n: int = 32) -> None:
        self.block_m = block_m
        self.block_n = block_n
        self._meta_batch: AttentionBatch | None = None
        self._meta: AttentionMetadata | None = None

    def metadata(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
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
        batch: AttentionBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        k_buf, v_buf = store_kv(k, v, layer, batch, kv_stored)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        meta = self.metadata(batch, q.device)
        spans = batch.item_spans
        if batch.is_decode:
            if spans is not None:
                raise ValueError("a decode batch has no item spans")
            out = decode_attention(
                q, k_buf, v_buf, batch.req_to_token, meta.seq_lens, meta.req_pool_indices,
                layer.scaling, self.block_n, window=layer.sliding_window,
            )
        else:
            if spans is not None and spans.shape[0] != q.shape[0] - batch.decode_tail:
                raise ValueError(
                    f"item_spans has {spans.shape[0]} rows for "
                    f"{q.shape[0] - batch.decode_tail} extend tokens"
                )
            out = extend_attention(
                q, k_buf, v_buf, batch.req_to_token, meta, layer.scaling,
                self.block_m, self.block_n, layer.sliding_window, spans,
            )
        return out.view(-1, layer.num_heads * layer.head_dim)
