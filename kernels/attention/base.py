"""The attention backend interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.attention.batch_view import AttentionBatch


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one decoder layer's attention on this rank.

    sliding_window: a query at position i sees a key at position j <= i only when
    i - j < sliding_window (a local layer); None: every earlier key (a global layer). Either
    way, a token in a bidirectional item also sees the whole item (`AttentionBatch.item_spans`).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: AttentionBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store k/v at batch.out_cache_loc (unless the caller already did: `kv_stored`, as
        KernelOps.rotary_store_kv does), then attend.

        q: [tokens, heads * head_dim]; k, v: [tokens, kv_heads * head_dim].
        Returns [tokens, heads * head_dim].
        """
        ...


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    batch: AttentionBatch,
    kv_stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new K/V ([tokens, kv_heads * head_dim]) at batch.out_cache_loc, unless
    `kv_stored` says the caller did; returns the layer's K and V pool buffers, which then hold
    them."""
    kv = batch.kv_pool
    if not kv_stored:
        shape = (-1, layer.num_kv_heads, layer.head_dim)
        kv.set_kv(layer.layer_id, batch.out_cache_loc, k.view(shape), v.view(shape))
    return kv.k_buffers[layer.layer_id], kv.v_buffers[layer.layer_id]
