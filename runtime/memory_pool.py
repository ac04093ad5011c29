"""KV memory: a request-to-token table and per-layer K/V buffers indexed by token slot. How many
slots the pool gets is decided in runtime/memory_plan.py (`size_kv_pool`).

Slot 0 of the K/V buffers is reserved as a padding slot that is never handed out, so padded
writes have a harmless target.

Device placement: the tables and buffers live on the model's device; the free lists are host
bookkeeping (a Python list of rows, a CPU tensor of slots). Slots handed out by `KVPool.alloc`
are CPU tensors; every method that puts them into a device tensor moves them there itself
(`non_blocking`: a host-to-device copy that the next kernel on the stream waits for).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ReqToTokenPool:
    """Row r lists, in order, the KV slots that hold request r's tokens.

    One more row than `size`, `padding_row`, is never handed out and stays all zeros (KV slot
    0, the padding slot): the rows that pad a static decode batch point there."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        shape = (size + 1, max_context_len)
        self.req_to_token = torch.zeros(shape, dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size))

    @property
    def padding_row(self) -> int:
        return self.size

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, index: int) -> None:
        if index in self._free:
            raise ValueError(f"request slot {index} freed twice")
        self._free.append(index)

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        """Row `index` takes `slots` (on any device) at positions start, start + 1, ..."""
        self.req_to_token[index, start : start + slots.numel()] = _on(slots, self.device)

    def write_each(self, indices: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """One slot per request: row indices[i] takes slots[i] at positions[i] (a decode step).
        `slots` may be on the host (as `KVPool.alloc` gives them)."""
        rows = torch.tensor(indices, dtype=torch.long, device=self.device)
        cols = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.req_to_token[rows, cols] = _on(slots, self.device)


    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] for every token of a step at once (all
        three on the table's device, as ModelRunner stages them)."""
        self.req_to_token[rows, cols] = slots


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host-to-device copy does not block the host."""
    return t.to(device, non_blocking=True)


@dataclass(frozen=True)
class KVLayout:
    """What one KV slot holds on this rank: K and V of every layer for its local KV heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def pool(self, size: int, device: str | torch.device = "cpu") -> KVPool:
        return KVPool(size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, device)


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
        self.device = torch.device(device)
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
        """Write K and V rows at `slots` (on any device); k and v on the pool's device."""
        slots = _on(slots, self.device)
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows of `slots` (any shape, any device), gathered into new tensors of shape
        slots.shape + (kv_heads, head_dim). `index_select` over the flattened slots: on CPU it is
        5x faster than advanced indexing with a 2-D index (15 against 77 us for 16 x 340 rows)."""
        flat = _on(slots.reshape(-1), self.device)
        shape = (*slots.shape, *self.k_buffers[layer_id].shape[1:])
        return (
            self.k_buffers[layer_id].index_select(0, flat).view(shape),
            self.v_buffers[layer_id].index_select(0, flat).view(shape),
        )
