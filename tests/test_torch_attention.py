"""The torch attention backend's prefill against attention written out token by token."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.base import AttentionLayer
from kernels.attention.torch_backend import _attend


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
    torch.testing.assert_close(_attend(q, k, v, layer), expected, atol=1e-5, rtol=1e-5)
