"""Rotary embedding module for the decoder: plain RoPE or MRoPE by position shape."""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps
from kernels.rotary import mrope_cos_sin


class MRotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float,
        mrope_section: tuple[int, ...],
        ops: KernelOps = TORCH_OPS,
        interleaved: bool = False,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = tuple(mrope_section)
        self.interleaved = interleaved
        self.rotary_dim = rotary_dim or head_dim  # fewer: partial rotary (kernels.rotary)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mrope_cos_sin(
            positions, self.head_dim, self.theta, self.mrope_section, self.interleaved,
            self.rotary_dim,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [tokens, heads, head_dim]."""
        return self.ops.apply_rotary_qk(q, k, cos, sin)
