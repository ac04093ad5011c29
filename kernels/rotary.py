"""Rotary position embedding, including the multimodal (MRoPE) variant.

The LLM rotates with "neox" layout (first half / second half of each head). With MRoPE each
frequency of a head takes its angle from one row (temporal, height, width) of a [3, tokens]
position tensor. Qwen2-VL / Qwen2.5-VL give the rows contiguous blocks of frequencies (sizes
`mrope_section`); Qwen3-VL interleaves them (frequency j goes to height when j % 3 == 1 and
j < 3 * section[1], to width when j % 3 == 2 and j < 3 * section[2], else to temporal).
"""

from __future__ import annotations

from functools import lru_cache

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# The tables below are cached per device: the same few every forward, and a forward on a GPU must
# not copy them from the host each time (a CUDA graph cannot capture that copy). The first
# forward on a device (an eager one: graphs are captured after warm-up runs) fills the cache.
# Callers never write to them.


@lru_cache(maxsize=16)
def inv_freq(rotary_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / theta**exponents).float().to(device)


@lru_cache(maxsize=16)
def mrope_axes(
    num_freqs: int,
    mrope_section: tuple[int, ...],
    interleaved: bool,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The position row (0 temporal, 1 height, 2 width) of each of a head's `num_freqs`
    frequencies: [num_freqs] long. Pure."""
    if not interleaved:
        blocks = [torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)]
        return torch.cat(blocks)[:num_freqs].to(device)
    axes = torch.zeros(num_freqs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * mrope_section[axis] : 3] = axis
    return axes.to(device)


def mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [tokens, head_dim] for positions [3, tokens] (or [tokens]: plain RoPE)."""
    freqs = inv_freq(head_dim, theta, positions.device)
    if positions.dim() == 1:
        angles = positions.float()[:, None] * freqs[None, :]
    else:
        per_axis = positions.float()[:, :, None] * freqs[None, None, :]  # [3, T, D/2]
        axes = mrope_axes(freqs.numel(), tuple(mrope_section), interleaved, positions.device)
        angles = per_axis.gather(0, axes.expand(1, per_axis.shape[1], -1)).squeeze(0)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]. Computed in float32."""
    dtype = x.dtype
    x32 = x.float()
    out = x32 * cos[:, None, :] + rotate_half(x32) * sin[:, None, :]
    return out.to(dtype)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] by the same angles:
    one rotation over both heads' rows (half the small operations of two; the same values)."""
    heads = q.shape[1]
    both = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    return both[:, :heads], both[:, heads:]
