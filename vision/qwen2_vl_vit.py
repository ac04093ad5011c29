"""The Qwen2-VL vision tower: pre-norm ViT blocks (LayerNorm, 2-D rotary attention, GELU-family
MLP) over every frame of every item, then a patch merger to the language model's width.

Built with the rank's `TPGroup` for TP mode, or with a one-rank `TPGroup()` for DP and auto mode,
where the tower holds full weights and issues no collective unless a call passes a `shard` group
(then it runs tensor-parallel on that rank's slice of the full weights).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.norm import LayerNorm
from runtime.layers.weights import LazyWeight
from runtime.model_config import VisionConfig
from vision.vit_common import (
    Pixels,
    VisionBlock,
    VisionMLP,
    VisionPatchEmbed,
    VisionPatchMerger,
    VisionRotary,
    VisionTower,
    check_heads,
    frame_segments,
    load_weights,
    vision_position_ids,
)

NORM_EPS = 1e-6


def qwen2_block(cfg: VisionConfig, tp: TPGroup, ops: KernelOps) -> VisionBlock:
    """LayerNorm with bias, MLP fc1 / fc2."""
    mlp = VisionMLP(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act, tp, ("fc1", "fc2"))
    return VisionBlock(cfg, tp, ops, lambda: LayerNorm(cfg.embed_dim, eps=NORM_EPS), mlp)


class Qwen2VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__()
        check_heads(cfg.num_heads, tp)
        self.cfg = cfg
        self.tp = tp
        self.spatial_merge_size = cfg.spatial_merge_size
        self.out_hidden_size = cfg.out_hidden_size
        self.patch_embed = VisionPatchEmbed(cfg.patch_dim, cfg.embed_dim)
        self.rotary = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList([qwen2_block(cfg, tp, ops) for _ in range(cfg.depth)])
        norm = LayerNorm(cfg.embed_dim, eps=NORM_EPS)
        self.merger = VisionPatchMerger(
            norm, cfg.embed_dim, cfg.out_hidden_size, cfg.spatial_merge_size, tp
        )

    def forward(
        self, pixel_values: Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches / merge**2, out_hidden_size].

        `shard`: run this call tensor-parallel over that group on full weights (see vit_common)."""
        x = self.patch_embed(pixel_values)
        rotary = self.rotary(vision_position_ids(grid_thw, self.spatial_merge_size))
        segments = frame_segments(grid_thw, x.device)  # rotary and segments: once per call
        for block in self.blocks:
            x = block(x, segments, rotary, shard)
        return self.merger(x, shard)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's `visual.` prefix; returns the loaded parameters."""
        return load_weights(self, weights)
