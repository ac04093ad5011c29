"""KV memory: a request-to-token table and per-layer K/V buffers indexed by token slot.

Slot 0 of the K/V buffers is reserved as a padding slot that is never handed out, so padded
writes have a harmless target.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Row r lists, in order, the KV slots that hold request r's tokens."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size))

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, index: int) -> None:
        if index in self._free:
            raise ValueError(f"request slot {index} freed twice")
        self._free.append(index)

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[index, start : start + slots.numel()] = slots


class KVPool:
    """K and V buffers of shape [num_slots + 1, kv_heads, head_dim] per layer."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)

    @property
    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n free slots, or None (and take nothing) when fewer are free."""
        if n > self._free.numel():
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64).cpu()))

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id][slots], self.v_buffers[layer_id][slots]

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()
