"""Gemma 3's vision side: the SigLIP tower over fixed-size images, the average pool to the soft
tokens and the projector to the decoder's width, as one module (the composite's `visual`).

An image arrives as patch rows [side**2, C * patch * patch] with grid (1, side, side), its
patches in row-major order (`video_processor.tile_patches`). The patch embedding (a linear map,
the checkpoint's Conv2d) plus one learned position per patch, then pre-norm blocks (LayerNorm,
attention within the image, LayerNorm, a gelu-tanh MLP), a last LayerNorm. No class token. Each
merge x merge window of the patch grid is averaged into one row (transformers' AvgPool2d with
stride = kernel), RMS-normed with `(1 + w)` and multiplied by the projection matrix.

Sharded like the other towers: q/k/v column-parallel by heads (a head count the TP size does not
divide is refused: use the DP encoder), the attention output and the MLP's second layer
row-parallel; the position table, the norms, the pool and the projector are replicated. Built
with a one-rank group (DP and auto mode) it holds full weights and issues no collective, unless
a call passes `shard` (then it runs tensor-parallel on that rank's slice of them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.attention.varlen import Segments
from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import QKVParallelLinear, RowParallelLinear
from runtime.layers.norm import LayerNorm
from runtime.layers.weights import LazyWeight
from runtime.model_config import VisionConfig
from runtime.models.gemma3 import OffsetRMSNorm
from vision.internvl_vit import STACKED, rename, replicated
from vision.vit_common import Pixels, TileTower, VisionMLP, check_heads, fixed_tiles, tile_segments
from vision.vit_common import load_weights as load_into

# checkpoint names (relative to the tower, `vision_model.` dropped) -> this module's; the q, k
# and v projections load into one merged module (InternViT's STACKED)
RENAMES = (("embeddings.patch_embedding.", "patch_embed.proj."), ("encoder.layers.", "layers."),
           ("embeddings.position_embedding.weight", "position_embedding"))  # fmt: skip


class SiglipAttention(nn.Module):
    """Merged q/k/v with biases (checkpoint q_proj, k_proj, v_proj), attention within each
    image, the row-parallel output projection."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps):
        super().__init__()
        check_heads(cfg.num_heads, tp)
        self.ops, self.head_dim = ops, cfg.head_dim
        dim, heads = cfg.embed_dim, cfg.num_heads
        self.qkv = QKVParallelLinear(dim, cfg.head_dim, heads, heads, tp, bias=True)
        self.out_proj = RowParallelLinear(dim, dim, tp, bias=True)

    def forward(
        self, x: torch.Tensor, segments: Segments, shard: TPGroup | None = None
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = (t.reshape(rows, -1, self.head_dim) for t in self.qkv(x, shard).chunk(3, -1))
        out = self.ops.varlen_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.out_proj(out.reshape(rows, -1), shard)


class SiglipBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps):
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.self_attn = SiglipAttention(cfg, tp, ops)
        self.layer_norm2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        names = ("fc1", "fc2")
        self.mlp = VisionMLP(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act, tp, names)

    def forward(
        self, x: torch.Tensor, segments: Segments, shard: TPGroup | None = None
    ) -> torch.Tensor:
        x = self.self_attn(self.layer_norm1(x), segments, shard).add_(x)
        return self.mlp(self.layer_norm2(x), shard).add_(x)


class Gemma3Projector(nn.Module):
    """RMSNorm with `(1 + w)`, then the [vision width, text width] projection matrix."""

    def __init__(self, width: int, out_dim: int, eps: float):
        super().__init__()
        self.mm_soft_emb_norm = OffsetRMSNorm(width, eps)
        self.mm_input_projection_weight = replicated(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.mm_soft_emb_norm(x), self.mm_input_projection_weight)


def average_pool(x: torch.Tensor, side: int, merge: int) -> torch.Tensor:
    """[images * side**2, C] in row-major patch order -> [images * (side / merge)**2, C]: the
    mean of every merge x merge window, windows in row-major order."""
    cells = side // merge
    windows = x.reshape(-1, cells, merge, cells, merge, x.shape[-1])
    return windows.mean(dim=(2, 4)).reshape(-1, x.shape[-1])


class SiglipVisionTower(TileTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__(cfg, tp)  # one image is one tile
        self.position_embedding = replicated(self.side**2, cfg.embed_dim)
        self.layers = nn.ModuleList([SiglipBlock(cfg, tp, ops) for _ in range(cfg.depth)])
        self.post_layernorm = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.multi_modal_projector = Gemma3Projector(
            cfg.embed_dim, cfg.out_hidden_size, cfg.norm_eps
        )

    def forward(
        self, pixel_values: Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[images * side**2, patch_dim] -> [images * side**2 / merge**2, out_hidden_size]."""
        images, length = fixed_tiles(grid_thw, self.side, "SigLIP"), self.side**2
        x = self.patch_embed(pixel_values).view(images, length, -1) + self.position_embedding
        x = x.reshape(images * length, -1)
        segments = tile_segments(images, length, x.device)
        for layer in self.layers:
            x = layer(x, segments, shard)
        pooled = average_pool(self.post_layernorm(x), self.side, self.spatial_merge_size)
        return self.multi_modal_projector(pooled)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's tower (`visual.` in the composite's layout, the
        projector under `multi_modal_projector.`); returns the loaded parameters."""
        return load_into(self, ((rename(name, RENAMES), w) for name, w in weights), STACKED)
