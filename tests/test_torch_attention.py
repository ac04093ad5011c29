"""The torch attention backend against attention written out token by token; the vision
towers' variable-length attention against one segment at a time; the KV and request tables'
batched reads and writes against one row at a time."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within_rounding

from kernels.attention.base import AttentionLayer
from kernels.attention.torch_backend import _attend
from kernels.attention.varlen import varlen_attention
from runtime.memory_pool import KVPool, ReqToTokenPool


def naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D], the last n positions of k/v [s, Hkv, D]; each query sees keys up to itself."""
    n, heads, _ = q.shape
    s, kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for i in range(n):
        visible = s - n + i + 1
        for h in range(heads):
            g = h // (heads // kv_heads)
            weights = torch.softmax(k[:visible, g] @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ v[:visible, g]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("new,total", [(9, 9), (3, 11), (1, 5)])
def test_prefill_matches_token_by_token(heads: int, kv_heads: int, new: int, total: int) -> None:
    torch.manual_seed(heads * 100 + new * 10 + total)
    dim = 8
    layer = AttentionLayer(0, heads, kv_heads, dim, dim**-0.5)
    q = torch.randn(new, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    expected = naive_causal(q, k, v, layer.scaling)
    # other summation orders of q.k (dim terms), the softmax and p.v (total terms each)
    assert_within_rounding(_attend(q, k, v, layer), expected, terms=dim + 2 * total)


def naive_segments(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """Full (bidirectional) attention inside each segment, one segment and head at a time."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        for h in range(q.shape[1]):
            weights = torch.softmax(q[start:end, h] @ k[start:end, h].T * scale, dim=-1)
            out[start:end, h] = weights @ v[start:end, h]
    return out


@pytest.mark.parametrize(
    "bounds",
    [[0, 24], [0, 8, 16, 24], [0, 5, 24], [0, 8, 8, 16, 24], [0, 3, 11, 19, 24]],
    ids=["one", "equal", "unequal", "empty-segment", "equal-and-not"],
)
def test_varlen_attention_stays_inside_each_segment(bounds: list[int]) -> None:
    """Equal segments take the no-copy path (views); others are gathered by length."""
    torch.manual_seed(len(bounds))
    q, k, v = (torch.randn(24, 3, 8) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    expected = naive_segments(q, k, v, cu, 0.3)
    # other summation orders of q.k (8 terms), the softmax and p.v (at most 24 terms each)
    assert_within_rounding(varlen_attention(q, k, v, cu, 0.3), expected, terms=8 + 2 * 24)


def test_kv_rows_gathered_by_a_2d_slot_table() -> None:
    pool = KVPool(32, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    torch.manual_seed(0)
    for layer in range(2):
        pool.k_buffers[layer].copy_(torch.randn(pool.k_buffers[layer].shape))
        pool.v_buffers[layer].copy_(torch.randn(pool.v_buffers[layer].shape))
    slots = torch.tensor([[3, 9, 9, 0], [31, 1, 2, 5]])
    k, v = pool.get_kv(1, slots)
    assert k.shape == v.shape == (2, 4, 2, 4)
    for r in range(2):
        for c in range(4):
            assert torch.equal(k[r, c], pool.k_buffers[1][slots[r, c]])
            assert torch.equal(v[r, c], pool.v_buffers[1][slots[r, c]])


def test_one_decode_slot_per_request_lands_at_its_position() -> None:
    pool = ReqToTokenPool(4, 16)
    pool.write(2, 0, torch.arange(5))
    pool.write_each([2, 0, 3], [5, 0, 7], torch.tensor([40, 41, 42]))
    assert pool.req_to_token[2, :6].tolist() == [0, 1, 2, 3, 4, 40]
    assert pool.req_to_token[0, 0] == 41 and pool.req_to_token[3, 7] == 42
    assert int(pool.req_to_token.count_nonzero()) == 7  # nothing else written
