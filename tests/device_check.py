"""A CPU stand-in for CUDA's device rules, to find host tensors mixed into device ops.

Tests put the "device" tensors on torch's meta device (shapes, no data) and run the code under
`DeviceRules`, which raises where CUDA would refuse the same op: every tensor an op reads must be
on one device, except 0-dim CPU tensors (scalars), copies between devices, and the CPU indices of
an indexing op (torch moves those itself). The meta device alone lets some of these through (an
index_put_ of CPU values into a meta tensor succeeds), CUDA does not. Reading a device value on
the host (`.item()`, `.tolist()`) fails on meta by itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# `aten.to` reaches a dispatch mode undecomposed under inference_mode (as `to.dtype_layout`,
# `to.device` or `to.other`); outside it, as `_to_copy`
COPIES = {
    aten.copy_, aten.to, aten._to_copy, aten._copy_from, aten._copy_from_and_resize,
    aten.lift_fresh,
}
INDEX_PUTS = {aten.index_put_, aten.index_put, aten._index_put_impl_}


class DeviceMixError(RuntimeError):
    """An op mixed tensors of two devices where CUDA would refuse it."""


def _is_scalar_on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def operands(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors whose devices must agree for `func` (on CUDA)."""
    packet = func.overloadpacket
    if packet in COPIES:
        return []
    if packet is aten.index:  # self[indices]: CPU indices are moved to the device
        return [args[0]]
    if packet in INDEX_PUTS:  # self[indices] = values: the values must be on self's device
        return [args[0], args[2] if len(args) > 2 else kwargs["values"]]
    leaves = tree_leaves((args, kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and not _is_scalar_on_cpu(t)]


def moves_host_data(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op copies a host tensor (more than a scalar) to another device."""
    packet = func.overloadpacket
    if packet in (aten._to_copy, aten.to):
        src, device = args[0], kwargs.get("device")
        target = args[1] if len(args) > 1 else None
        if isinstance(target, torch.Tensor):  # to.other: the other tensor's device
            device = target.device
        elif isinstance(target, torch.device):  # to.device
            device = target
        return device is not None and device.type != "cpu" and src.device.type == "cpu"
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        return dst.device.type != "cpu" and src.device.type == "cpu" and src.dim() > 0
    return False


class DeviceRules(TorchDispatchMode):
    """Raise DeviceMixError on the first op whose operands sit on two devices; count the
    host-to-device copies (`copies`)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        devices = {t.device for t in operands(func, args, kwargs)}
        if len(devices) > 1:
            names = sorted(str(d) for d in devices)
            raise DeviceMixError(f"{func} mixes devices {names}")
        self.copies += moves_host_data(func, args, kwargs)
        return func(*args, **kwargs)
