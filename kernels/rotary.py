"""Rotary position embedding, including the multimodal (MRoPE) variant.

The LLM rotates with "neox" layout (first half / second half of each head). With MRoPE each
frequency of a head takes its angle from one row (temporal, height, width) of a [3, tokens]
position tensor. Qwen2-VL / Qwen2.5-VL give the rows contiguous blocks of frequencies (sizes
`mrope_section`); Qwen3-VL interleaves them (frequency j goes to height when j % 3 == 1 and
j < 3 * section[1], to width when j % 3 == 2 and j < 3 * section[2], else to temporal).

Partial rotary (GLM-4: only the first `rotary_dim` dims of a head turn, as adjacent pairs) runs
through the same neox tables: the decoder reorders each head's q and k features once, at load
(`rotary_permutation`), so that the rotated pairs sit at (j, j + head_dim / 2) and the dims that
do not turn sit at frequencies of angle zero (cos 1, sin 0: passed through exactly). q . k is the
same under one permutation of both.
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


def rotary_permutation(head_dim: int, rotary_dim: int, pairs: bool) -> torch.Tensor:
    """Order of a head's features that puts a partial (or pairwise) rotary into neox layout:
    new feature i is old feature `perm[i]`. The rotated dims (adjacent pairs with `pairs`, else
    halves of the first `rotary_dim`) fill the first rotary_dim / 2 slots of each half, the
    dims past `rotary_dim` the rest. The identity for a full neox rotary. Pure."""
    if rotary_dim % 2 or head_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dim {rotary_dim} does not fit head_dim {head_dim}")
    rot = torch.arange(rotary_dim)
    first, second = (rot[0::2], rot[1::2]) if pairs else rot.chunk(2)
    rest = torch.arange(rotary_dim, head_dim)
    keep = (head_dim - rotary_dim) // 2
    return torch.cat((first, rest[:keep], second, rest[keep:]))


def mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...],
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [tokens, head_dim] for positions [3, tokens] (or [tokens]: plain RoPE).
    With `rotary_dim` < head_dim only its rotary_dim / 2 frequencies turn; the other slots of
    each half get angle zero (features laid out by `rotary_permutation`)."""
    rotary_dim = rotary_dim or head_dim
    freqs = inv_freq(rotary_dim, theta, positions.device)
    if positions.dim() == 1:
        angles = positions.float()[:, None] * freqs[None, :]
    else:
        per_axis = positions.float()[:, :, None] * freqs[None, None, :]  # [3, T, D/2]
        axes = mrope_axes(freqs.numel(), tuple(mrope_section), interleaved, positions.device)
        angles = per_axis.gather(0, axes.expand(1, per_axis.shape[1], -1)).squeeze(0)
    if rotary_dim < head_dim:
        angles = torch.nn.functional.pad(angles, (0, (head_dim - rotary_dim) // 2))
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
