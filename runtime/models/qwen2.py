"""The Qwen2 decoder of Qwen2-VL and Qwen2.5-VL, and the Qwen3 decoder of Qwen3-VL, on
tensor-parallel layers.

Qwen3 differs in three places, each a config switch here: RMSNorm over every head of q and k
before the rotary (`qk_norm`), no q/k/v bias (`attention_bias`), and interleaved MRoPE sections
(`mrope_interleaved`). GLM-4 (GLM-4.1V) switches on a partial, pairwise rotary (`rotary_dim`,
`rotary_pairs`: q and k features reordered once at load, see kernels/rotary.py) and RMSNorms on
the attention and MLP outputs before their residual adds (`post_norms`).

DeepStack (Qwen3-VL) adds vision features of some encoder blocks to the hidden states after the
first decoder layers: `deepstack[:, i]` after layer i, zero rows at text positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.attention import AttentionBackend, AttentionLayer
from kernels.ops import TORCH_OPS, KernelOps
from kernels.rotary import rotary_permutation
from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch
from runtime.layers.activation import SiluAndMul
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import MRotaryEmbedding
from runtime.layers.weights import LazyWeight, as_lazy
from runtime.memory_pool import KVLayout
from runtime.model_config import TextConfig


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: TextConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], tp, False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp, bias=False)
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2Attention(nn.Module):
    def __init__(
        self,
        cfg: TextConfig,
        layer_id: int,
        tp: TPGroup,
        backend: AttentionBackend,
        ops: KernelOps = TORCH_OPS,
    ):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            tp,
            bias=cfg.attention_bias,
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, tp, bias=False)
        self.layer = AttentionLayer(
            layer_id=layer_id,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=cfg.head_dim,
            scaling=cfg.head_dim**-0.5,
        )
        self.rotary = MRotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.mrope_section, ops, cfg.mrope_interleaved,
            cfg.rotary_dim,
        )
        rotary_dim = cfg.rotary_dim or cfg.head_dim
        if rotary_dim < cfg.head_dim or cfg.rotary_pairs:
            perm = rotary_permutation(cfg.head_dim, rotary_dim, cfg.rotary_pairs)
            permute_qk_on_load(self.qkv_proj, perm)
        self.backend = backend
        self.rotary_store_kv = ops.rotary_store_kv

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        d = self.layer.head_dim
        q, k = q.reshape(-1, self.layer.num_heads, d), k.reshape(-1, self.layer.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view_as(q)  # norms take [rows, dim]
            k = self.k_norm(k.reshape(-1, d)).view_as(k)
        store = self.rotary_store_kv  # rotates, and writes K and V to the pool, in one kernel
        if store is not None:
            pool, layer_id = batch.kv_pool, self.layer.layer_id
            q, k = store(
                q, k, v.view_as(k), *cos_sin,
                pool.k_buffers[layer_id], pool.v_buffers[layer_id], batch.out_cache_loc,
            )
        else:
            q, k = self.rotary(q, k, *cos_sin)
        stored = store is not None
        out = self.backend.forward(q.flatten(1), k.flatten(1), v, self.layer, batch, stored)
        return self.o_proj(out)


def permute_qk_on_load(qkv: QKVParallelLinear, perm: torch.Tensor) -> None:
    """Reorder every head's features of the q and k checkpoint tensors (weight and bias) by
    `perm` as they load; v is unchanged. The tensor is read whole, then sliced as usual."""

    def wrap(loader: Callable[..., None]) -> Callable[..., None]:
        def load(
            param: nn.Parameter, weight: LazyWeight | torch.Tensor, shard: str | None = None
        ) -> None:
            if shard in ("q", "k"):
                full = as_lazy(weight).load()
                heads = full.shape[0] // perm.numel()
                order = (torch.arange(heads)[:, None] * perm.numel() + perm).flatten()
                weight = full[order]
            loader(param, weight, shard)

        return load

    for param in (qkv.weight, qkv.bias):
        if param is not None:
            param.weight_loader = wrap(param.weight_loader)


class Qwen2DecoderLayer(nn.Module):
    ATTENTION: type[nn.Module] = Qwen2Attention
    MLP: type[nn.Module] = Qwen2MLP
    NORM: type[nn.Module] = RMSNorm

    def __init__(
        self,
        cfg: TextConfig,
        layer_id: int,
        tp: TPGroup,
        backend: AttentionBackend,
        ops: KernelOps = TORCH_OPS,
    ):
        super().__init__()
        self.self_attn = self.ATTENTION(cfg, layer_id, tp, backend, ops)
        self.mlp = self.MLP(cfg, tp, ops)
        self.input_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.post_norms:
            self.post_self_attn_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, ops)
            self.post_mlp_layernorm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_norms = cfg.post_norms

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, batch)
        if self.post_norms:
            x = self.post_self_attn_layernorm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (self.post_mlp_layernorm(x) if self.post_norms else x), residual


class Qwen2Model(nn.Module):
    LAYER: type[nn.Module] = Qwen2DecoderLayer
    NORM: type[nn.Module] = RMSNorm

    def __init__(
        self, cfg: TextConfig, tp: TPGroup, backend: AttentionBackend, ops: KernelOps = TORCH_OPS
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.LAYER(cfg, i, tp, backend, ops) for i in range(cfg.num_hidden_layers)
        )
        self.norm = self.NORM(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(
        self, embeds: torch.Tensor, batch: ForwardBatch, deepstack: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`deepstack`: [tokens, levels, hidden] or None; level i is added after layer i."""
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(batch.positions)
        x, residual = embeds, None
        levels = 0 if deepstack is None else deepstack.shape[1]
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos_sin, batch)
            if i < levels:
                x = x + deepstack[:, i]
        x, _ = self.norm(x, residual)
        return x


class Qwen2ForCausalLM(nn.Module):
    """Decoder plus LM head; `forward` takes input embeddings (text and vision already fused)."""

    MODEL: type[nn.Module] = Qwen2Model

    def __init__(
        self, cfg: TextConfig, tp: TPGroup, backend: AttentionBackend, ops: KernelOps = TORCH_OPS
    ):
        super().__init__()
        self.cfg = cfg
        self.model = self.MODEL(cfg, tp, backend, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def kv_layout(self) -> KVLayout:
        """What one KV slot holds for this rank's shard: every layer's local KV heads."""
        attn = self.model.layers[0].self_attn.layer
        dtype = next(self.parameters()).dtype
        return KVLayout(len(self.model.layers), attn.num_kv_heads, self.cfg.head_dim, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids.clamp(0, self.cfg.vocab_size - 1))

    def forward(
        self, embeds: torch.Tensor, batch: ForwardBatch, deepstack: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.model(embeds, batch, deepstack)
        if not batch.is_decode:  # decode: every row is last
            hidden = hidden[batch.last_token_indices]
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    STACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def checkpoint_target(self, name: str) -> tuple[str, int | str | None]:
        """Map a checkpoint name (relative to this module) to (parameter name, shard id)."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.STACKED:
                merged, shard = self.STACKED[part]
                return ".".join(parts[:i] + [merged] + parts[i + 1 :]), shard
        return name, None
