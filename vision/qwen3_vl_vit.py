"""The Qwen3-VL vision tower: LayerNorm ViT blocks with 2-D rotary attention, a learned position
table resampled to every grid, and DeepStack.

- Patch embedding (16-pixel patches, with bias), plus the learned [side x side] position table
  resampled bilinearly (corners aligned) to the item's (h, w) patch grid, in the processor's
  merge-window order and repeated over the frames.
- The blocks listed in `deepstack_visual_indexes` also feed their own merger (LayerNorm over the
  concatenated merge x merge neighbours, then a two-layer GELU MLP). Their outputs are the
  DeepStack levels that the decoder adds to its hidden states after its first layers.

One output row per merged token holds everything the language model needs of it:
`[main | level 0 | level 1 | ...]`, `out_hidden_size * (1 + levels)` wide (`embed_row_dim`).
So every path that moves rows (the DP encoder's one all-gather, the encoder cache, chunked
prefill slicing) carries the DeepStack levels with the main embedding by construction.

Built with the rank's `TPGroup` for TP mode, or with a one-rank `TPGroup()` for DP and auto mode,
where the tower holds full weights and issues no collective unless a call passes a `shard` group.
The position table is replicated and its resampling is local: no collective outside the blocks
and mergers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from runtime.layers.norm import LayerNorm
from runtime.layers.weights import LazyWeight, default_weight_loader, set_weight_loader
from runtime.model_config import VisionConfig
from vision.vit_common import (
    Pixels,
    VisionBlock,
    VisionMLP,
    VisionPatchEmbed,
    VisionRotary,
    VisionTower,
    check_heads,
    frame_segments,
    load_weights,
    vision_position_ids,
)

NORM_EPS = 1e-6


def position_table_taps(
    grid_thw: torch.Tensor, side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (corners aligned) taps into a [side x side] table for every patch, in the
    processor's merge-window order: (indices [N, 4] long, weights [N, 4] float32). Pure."""
    grid = grid_thw.long().cpu()
    rowcol = vision_position_ids(grid, merge).to(torch.float32)
    counts = grid.prod(dim=1)
    heights = torch.repeat_interleave(grid[:, 1], counts)
    widths = torch.repeat_interleave(grid[:, 2], counts)
    rows, row_w = _axis_taps(rowcol[:, 0], heights, side)
    cols, col_w = _axis_taps(rowcol[:, 1], widths, side)
    indices = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 4)
    weights = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return indices, weights


def _axis_taps(
    index: torch.Tensor, size: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries around each target position of one axis, and their weights."""
    src = index * (side - 1) / torch.clamp(size - 1, min=1).to(torch.float32)
    low = torch.floor(src)
    frac = (src - low)[:, None]
    taps = (low.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    weights = torch.cat((1 - frac, frac), dim=1)
    return taps, weights


def qwen3_block(cfg: VisionConfig, tp: TPGroup, ops: KernelOps) -> VisionBlock:
    """LayerNorm with bias, MLP linear_fc1 / linear_fc2."""
    names = ("linear_fc1", "linear_fc2")
    mlp = VisionMLP(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act, tp, names)
    return VisionBlock(cfg, tp, ops, lambda: LayerNorm(cfg.embed_dim, eps=NORM_EPS), mlp)


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (per patch, or after the merge x merge concatenation for the DeepStack mergers),
    then linear_fc1 column-parallel, GELU, linear_fc2 row-parallel."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup, postshuffle_norm: bool):
        super().__init__()
        self.hidden = cfg.embed_dim * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.hidden if postshuffle_norm else cfg.embed_dim, eps=NORM_EPS)
        self.linear_fc1 = ColumnParallelLinear(self.hidden, [self.hidden], tp, bias=True)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.hidden, cfg.out_hidden_size, tp, bias=True)

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.hidden))
        else:
            x = self.norm(x).reshape(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x, shard)), shard)


class Qwen3VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__()
        check_heads(cfg.num_heads, tp)
        self.cfg = cfg
        self.tp = tp
        self.spatial_merge_size = cfg.spatial_merge_size
        self.out_hidden_size = cfg.embed_row_dim  # the width of one output row, all levels
        self.side = round(cfg.num_position_embeddings**0.5)
        self.patch_embed = VisionPatchEmbed(cfg.patch_dim, cfg.embed_dim, bias=cfg.patch_bias)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.pos_embed.weight.requires_grad_(False)
        set_weight_loader(self.pos_embed.weight, default_weight_loader)
        self.rotary = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList([qwen3_block(cfg, tp, ops) for _ in range(cfg.depth)])
        self.merger = Qwen3PatchMerger(cfg, tp, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(cfg, tp, postshuffle_norm=True) for _ in range(cfg.num_deepstack)]
        )
        self.deepstack_levels = {b: i for i, b in enumerate(cfg.deepstack_visual_indexes)}

    def forward(
        self, pixel_values: Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches / merge**2, out_hidden_size * (1 + levels)].

        `shard`: run this call tensor-parallel over that group on full weights (see vit_common)."""
        x = self.patch_embed(pixel_values) + self.positions(grid_thw)
        rotary = self.rotary(vision_position_ids(grid_thw, self.spatial_merge_size))
        segments = frame_segments(grid_thw, x.device)  # rotary and segments: once per call
        levels: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, segments, rotary, shard)
            if i in self.deepstack_levels:
                merger = self.deepstack_merger_list[self.deepstack_levels[i]]
                levels.append(merger(x, shard))
        return torch.cat([self.merger(x, shard), *levels], dim=-1)

    def positions(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned position table resampled to every patch: [num_patches, embed_dim]."""
        indices, weights = position_table_taps(grid_thw, self.side, self.spatial_merge_size)
        table = self.pos_embed(indices.to(self.device))  # [N, 4, embed_dim]
        weights = weights.to(self.device, table.dtype)
        return (table * weights[:, :, None]).sum(dim=1)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's `visual.` prefix; returns the loaded parameters."""
        return load_weights(self, weights)
