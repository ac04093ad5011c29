"""Rotary position embedding, including the multimodal (MRoPE) variant.

The LLM rotates with "neox" layout (first half / second half of each head). With MRoPE the
frequency bands of a head are split into sections (temporal, height, width) and each section takes
its angle from the matching row of a [3, tokens] position tensor.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / theta**exponents).float()


def mrope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, mrope_section: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [tokens, head_dim] for positions [3, tokens] (or [tokens]: plain RoPE)."""
    freqs = inv_freq(head_dim, theta).to(positions.device)
    if positions.dim() == 1:
        angles = positions.float()[:, None] * freqs[None, :]
    else:
        per_axis = positions.float()[:, :, None] * freqs[None, None, :]  # [3, T, D/2]
        chunks = per_axis.split(list(mrope_section), dim=-1)
        angles = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
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
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] by the same angles."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
