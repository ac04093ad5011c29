"""Normalisation layers (replicated on every rank)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps
from runtime.layers.weights import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, ops: KernelOps = TORCH_OPS):
        super().__init__()
        self.eps = eps
        self.ops = ops
        weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight = set_weight_loader(weight, default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """torch LayerNorm whose parameters carry the default weight loader."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)
        for p in self.parameters():
            p.requires_grad_(False)
            set_weight_loader(p, default_weight_loader)
