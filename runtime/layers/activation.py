"""Activation modules."""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps


class SiluAndMul(nn.Module):
    def __init__(self, ops: KernelOps = TORCH_OPS):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
