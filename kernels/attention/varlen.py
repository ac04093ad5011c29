"""Variable-length bidirectional attention for the vision towers: the torch reference.

`cu_seqlens` (cumulative segment lengths, starting at 0) splits the tokens into segments (frames
or windows); attention never crosses a segment. The Triton kernel is in
kernels/triton/varlen_attention.py; kernels/ops.py chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (q, k, v, cu_seqlens, scale) -> out; q/k/v/out: [tokens, heads, head_dim]
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention inside each segment of `cu_seqlens`; q/k/v: [N, heads, head_dim].

    Segments of equal length are batched into one call, so the many same-sized windows or frames
    of a batch cost one kernel launch each length."""
    bounds = cu_seqlens.long().cpu()
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    uniform = int(lengths[0]) if lengths.numel() and bool((lengths == lengths[0]).all()) else 0
    if uniform and uniform * lengths.numel() == q.shape[0]:
        # the segments tile the tokens in one length (one frame, or equal frames): views, no copy
        split = (lengths.numel(), uniform, *q.shape[1:])
        out = _batched_attention(q.view(split), k.view(split), v.view(split), scale)
        return out.reshape(q.shape)
    out = torch.empty_like(q)
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        index = starts[lengths == length][:, None] + torch.arange(length)  # [segments, length]
        index = index.to(q.device)
        out[index] = _batched_attention(q[index], k[index], v[index], scale)
    return out


def _batched_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q/k/v: [segments, length, heads, head_dim] -> the same shape."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2)

