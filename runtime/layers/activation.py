"""Activation modules."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
