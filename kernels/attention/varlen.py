"""Variable-length bidirectional attention for the vision towers: the torch reference.

`cu_seqlens` (cumulative segment lengths, starting at 0) splits the tokens into segments (frames
or windows); attention never crosses a segment. The Triton kernel is in
kernels/triton/varlen_attention.py; kernels/ops.py chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Segments:
    """`cu_seqlens` prepared once per encoder call and shared by every block that attends over
    the same segments: host bounds (what the launch needs, with no device read), the device copy
    a kernel reads, the longest segment, and (built on first use, by the torch path) the token
    index of each group of equal-length segments on the device."""

    host_bounds: torch.Tensor  # [segments + 1] int64, CPU
    device_bounds: torch.Tensor  # the same, int32, on the device
    device: torch.device

    @staticmethod
    def build(cu_seqlens: torch.Tensor, device: torch.device | str) -> Segments:
        host = cu_seqlens.long().cpu()  # the towers build cu_seqlens on the host: no device sync
        bounds = host.to(device=device, dtype=torch.int32, non_blocking=True)
        return Segments(host, bounds, torch.device(device))

    @property
    def count(self) -> int:
        return self.host_bounds.numel() - 1

    @property
    def tokens(self) -> int:
        return int(self.host_bounds[-1]) if self.count >= 0 else 0

    @cached_property
    def lengths(self) -> torch.Tensor:
        return self.host_bounds[1:] - self.host_bounds[:-1]

    @cached_property
    def max_len(self) -> int:
        return int(self.lengths.max()) if self.count > 0 else 0

    @cached_property
    def uniform(self) -> int:
        """The one length of every segment when they all share it, else 0."""
        lengths = self.lengths
        if not lengths.numel() or not bool((lengths == lengths[0]).all()):
            return 0
        return int(lengths[0])

    @cached_property
    def groups(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """(length, [segments, length] token index on the device) per nonzero segment length."""
        starts, out = self.host_bounds[:-1], []
        for length in self.lengths.unique().tolist():
            if length:
                index = starts[self.lengths == length][:, None] + torch.arange(length)
                out.append((length, index.to(self.device, non_blocking=True)))
        return tuple(out)


def as_segments(cu_seqlens: torch.Tensor | Segments, device: torch.device) -> Segments:
    """Segments as given, or prepared now (a caller with one block only may pass the tensor)."""
    return cu_seqlens if isinstance(cu_seqlens, Segments) else Segments.build(cu_seqlens, device)


# (q, k, v, segments or cu_seqlens, scale) -> out; q/k/v/out: [tokens, heads, head_dim]
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | Segments, float], torch.Tensor
]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Segments,
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention inside each segment of `cu_seqlens`; q/k/v: [N, heads, head_dim].

    Segments of equal length are batched into one call, so the many same-sized windows or frames
    of a batch cost one kernel launch each length."""
    segments = as_segments(cu_seqlens, q.device)
    uniform = segments.uniform
    if uniform and uniform * segments.count == q.shape[0]:
        # the segments tile the tokens in one length (one frame, or equal frames): views, no copy
        split = (segments.count, uniform, *q.shape[1:])
        out = _batched_attention(q.view(split), k.view(split), v.view(split), scale)
        return out.reshape(q.shape)
    out = torch.empty_like(q)
    for _, index in segments.groups:
        out[index] = _batched_attention(q[index], k[index], v[index], scale)
    return out


def _batched_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q/k/v: [segments, length, heads, head_dim] -> the same shape."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2)

