"""What an attention backend reads from a step's batch, said as protocols of this floor.

The runtime's `ForwardBatch` (with its `KVPool` and `DecodeTables`) satisfies them by its shape
alone: kernels never import the runtime that builds the batch. Every member is read-only here;
a backend only reads the batch, and writes K/V only through `KVBuffers.set_kv`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVBuffers(Protocol):
    """The KV pool: per layer, K and V rows indexed by slot."""

    @property
    def device(self) -> torch.device: ...

    @property
    def k_buffers(self) -> list[torch.Tensor]: ...

    @property
    def v_buffers(self) -> list[torch.Tensor]: ...

    def set_kv(
        self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def get_kv(
        self, layer_id: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecodeTablesView(Protocol):
    """A static decode's per-request rows and lengths on the device, and the columns every
    gather covers."""

    @property
    def req_pool_indices(self) -> torch.Tensor: ...

    @property
    def seq_lens(self) -> torch.Tensor: ...

    @property
    def width(self) -> int: ...


class AttentionBatch(Protocol):
    """One forward's requests as the backends see them: host lists per request (placeholders
    when `decode_tables` is set), the request-to-token table, the new tokens' KV slots, and
    the last `decode_tail` requests decoding one token each in an extend."""

    @property
    def out_cache_loc(self) -> torch.Tensor: ...

    @property
    def kv_pool(self) -> KVBuffers: ...

    @property
    def req_to_token(self) -> torch.Tensor: ...

    @property
    def req_pool_indices_list(self) -> list[int]: ...

    @property
    def prefix_lens_list(self) -> list[int]: ...

    @property
    def extend_lens_list(self) -> list[int]: ...

    @property
    def seq_lens_list(self) -> list[int]: ...

    @property
    def decode_tail(self) -> int: ...

    @property
    def decode_tables(self) -> DecodeTablesView | None: ...

    @property
    def is_decode(self) -> bool: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def extend_count(self) -> int: ...

    @property
    def item_spans(self) -> torch.Tensor | None:
        """[tokens of the extend requests (not a decode tail), 2] int32 on the batch's device:
        for a token inside a bidirectional media item (a family whose image attention is
        "bidirectional_item"), the absolute positions [start, end) of that item within its
        request's sequence, else (0, 0). A query at position i then sees a key at j when
        j <= i (within the layer's sliding window) or start_i <= j < end_i. None when no token
        of the batch lies in such an item (plain causal attention)."""
        ...


__all__ = ["AttentionBatch", "DecodeTablesView", "KVBuffers"]
