"""Lazy checkpoint tensors and the default weight loader.

A `LazyWeight` names a checkpoint tensor without reading it; parallel layers narrow it to their
own slice before `load()`, so each rank reads only the bytes it keeps.
"""

from __future__ import annotations

from typing import Any

import torch


class LazyWeight:
    def __init__(self, source: Any, shape: tuple[int, ...], box: tuple[tuple[int, int], ...] = ()):
        self.source = source  # a torch.Tensor or a safetensors slice
        self.full_shape = tuple(shape)
        self.box = box or tuple((0, n) for n in shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> LazyWeight:
        return cls(tensor, tuple(tensor.shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim = dim % len(self.box)
        lo, hi = self.box[dim]
        if start < 0 or lo + start + length > hi:
            raise ValueError(f"slice [{start}, {start + length}) outside dim {dim} of {self.shape}")
        box = list(self.box)
        box[dim] = (lo + start, lo + start + length)
        return LazyWeight(self.source, self.full_shape, tuple(box))

    def chunk(self, sizes: list[int], dim: int = 0) -> list[LazyWeight]:
        parts, start = [], 0
        for size in sizes:
            parts.append(self.narrow(dim, start, size))
            start += size
        return parts

    def load(self) -> torch.Tensor:
        index = tuple(slice(a, b) for a, b in self.box)
        if not index:
            return self.source[...] if isinstance(self.source, torch.Tensor) else self.source[:]
        return self.source[index]


def as_lazy(weight: LazyWeight | torch.Tensor) -> LazyWeight:
    return weight if isinstance(weight, LazyWeight) else LazyWeight.of(weight)


def copy_checked(target: torch.Tensor, source: torch.Tensor, name: str = "") -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(
            f"shape mismatch for {name or 'parameter'}: "
            f"model {tuple(target.shape)} vs checkpoint {tuple(source.shape)}"
        )
    with torch.no_grad():
        target.copy_(source.to(target.dtype))


def default_weight_loader(param: torch.Tensor, weight: LazyWeight | torch.Tensor) -> None:
    copy_checked(param.data, as_lazy(weight).load())


def set_weight_loader(param: torch.nn.Parameter, loader) -> torch.nn.Parameter:
    param.weight_loader = loader
    return param


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the TP size ({denominator})")
    return numerator // denominator
