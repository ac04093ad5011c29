"""The attention backend interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend needs to know about one decoder layer's attention on this rank."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store k/v at batch.out_cache_loc, then attend.

        q: [tokens, heads * head_dim]; k, v: [tokens, kv_heads * head_dim].
        Returns [tokens, heads * head_dim].
        """
        ...
