"""The Gemma 3 decoder on tensor-parallel layers: the Qwen2 decoder's blocks with Gemma's parts.

- Every RMSNorm scales by `(1 + w)`: the checkpoint's `w` is loaded as `1 + w` (`OffsetRMSNorm`;
  in bfloat16 that sum is rounded once at load).
- q and k are RMS-normed per head before the rotary; q is scaled by query_pre_attn_scalar**-0.5.
- The MLP is GeGLU: gelu (tanh approximation) of the gate times the up projection.
- Norms before and after both the attention and the MLP: the Qwen2 block's post-norm switch,
  the checkpoint's `post_attention_layernorm` / `pre_feedforward_layernorm` /
  `post_feedforward_layernorm` renamed onto it (runtime/families/gemma3.py).
- Layers alternate local and global attention: a local layer sees the last `sliding_window`
  positions (AttentionLayer.sliding_window) and turns with base `rope_local_theta`; a global
  layer sees every position and turns with `rope_theta`, its positions divided by the linear
  RoPE scaling factor. The KV of a local layer is kept whole (no windowed KV memory).
- Input embeddings are scaled by sqrt(hidden) (media rows are placed after, unscaled); the
  LM head is tied to them; the final logits are tanh-softcapped when the config says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBackend
from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch
from runtime.layers.norm import RMSNorm
from runtime.layers.weights import LazyWeight, as_lazy, copy_checked, set_weight_loader
from runtime.model_config import TextConfig
from runtime.models.qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2MLP,
    Qwen2Model,
)

CosSin = tuple[torch.Tensor, torch.Tensor]


def load_plus_one(param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
    copy_checked(param.data, as_lazy(weight).load().float() + 1.0)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight `w` scales by `1 + w`."""

    def __init__(self, dim: int, eps: float = 1e-6, ops: KernelOps = TORCH_OPS):
        super().__init__(dim, eps, ops)
        set_weight_loader(self.weight, load_plus_one)


class GeluTanhAndMul(nn.Module):
    """x holds [gate | up]: gelu_tanh(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


class Gemma3MLP(Qwen2MLP):
    def __init__(self, cfg: TextConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__(cfg, tp, ops)
        self.act = GeluTanhAndMul()


def is_sliding(cfg: TextConfig, layer_id: int) -> bool:
    return bool(cfg.sliding_windows and cfg.sliding_windows[layer_id])


class Gemma3Attention(Qwen2Attention):
    """Qwen2's attention with per-head `(1 + w)` q/k norms, Gemma's q scaling and this layer's
    sliding window (None on a global layer)."""

    def __init__(self, cfg: TextConfig, layer_id: int, *shard: Any) -> None:
        """`shard`: Qwen2Attention's (tp, backend, ops)."""
        super().__init__(cfg, layer_id, *shard)
        assert self.q_norm is not None  # Gemma's config sets qk_norm
        ops = self.q_norm.ops
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        window = cfg.sliding_windows[layer_id] if is_sliding(cfg, layer_id) else None
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.layer = dataclasses.replace(self.layer, scaling=scalar**-0.5, sliding_window=window)
        if is_sliding(cfg, layer_id):
            self.rotary.theta = cfg.rope_local_theta


class Gemma3DecoderLayer(Qwen2DecoderLayer):
    ATTENTION = Gemma3Attention
    MLP = Gemma3MLP
    NORM = OffsetRMSNorm


class Gemma3Model(Qwen2Model):
    LAYER = Gemma3DecoderLayer
    NORM = OffsetRMSNorm

    def __init__(
        self, cfg: TextConfig, tp: TPGroup, backend: AttentionBackend, ops: KernelOps = TORCH_OPS
    ):
        super().__init__(cfg, tp, backend, ops)
        self.cfg = cfg

    def rotaries(self, positions: torch.Tensor) -> tuple[CosSin, CosSin]:
        """(global, local) cos/sin: the global layers' positions divided by the linear factor."""
        kinds = [is_sliding(self.cfg, i) for i in range(len(self.layers))]
        global_rotary = self.layers[kinds.index(False)].self_attn.rotary if False in kinds else None
        local_rotary = self.layers[kinds.index(True)].self_attn.rotary if True in kinds else None
        scaled = positions.float() / self.cfg.rope_linear_factor
        glob = global_rotary.cos_sin(scaled) if global_rotary is not None else None
        local = local_rotary.cos_sin(positions) if local_rotary is not None else None
        return glob, local  # type: ignore[return-value]

    def forward(
        self, embeds: torch.Tensor, batch: ForwardBatch, deepstack: torch.Tensor | None = None
    ) -> torch.Tensor:
        glob, local = self.rotaries(batch.positions)
        x, residual = embeds, None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, local if is_sliding(self.cfg, i) else glob, batch)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(Qwen2ForCausalLM):
    """The Gemma 3 decoder plus its tied LM head; see the module docstring."""

    MODEL = Gemma3Model

    def __init__(
        self, cfg: TextConfig, tp: TPGroup, backend: AttentionBackend, ops: KernelOps = TORCH_OPS
    ):
        super().__init__(cfg, tp, backend, ops)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().embed(input_ids)
        return rows * torch.tensor(self.embed_scale, dtype=rows.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
