"""Activation kernels: torch reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds [gate | up] on its last dimension; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # silu's output is new: multiplied in place


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the same values with one new tensor instead of three."""
    return (1.702 * x).sigmoid_().mul_(x)


def get_activation(name: str):
    table = {
        "quick_gelu": quick_gelu,
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in table:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(table)}")
    return table[name]
