"""The Qwen2.5-VL vision tower: RMSNorm ViT blocks with a gated (SwiGLU) MLP and window attention.

Before the blocks, merge units (merge x merge neighbouring patches) are reordered so that each
window of the merged grid is contiguous; most blocks attend inside a window, the blocks listed in
`fullatt_block_indexes` attend over a whole frame. After the merger the window order is undone,
so the output rows follow the processor's order like any other tower.

Built with the rank's `TPGroup` for TP mode, or with a one-rank `TPGroup()` for DP and auto mode,
where the tower holds full weights and issues no collective unless a call passes a `shard` group
(then it runs tensor-parallel on that rank's slice of the full weights).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import get_activation
from kernels.attention.varlen import Segments
from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from runtime.layers.norm import RMSNorm
from runtime.layers.weights import LazyWeight
from runtime.model_config import VisionConfig
from vision.vit_common import (
    Pixels,
    VisionBlock,
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
STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def window_index(
    grid_thw: torch.Tensor, window_size: int, patch_size: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of merge units that makes every window contiguous, and the window boundaries.

    A window covers `window_size // (merge * patch_size)` merge units per side; windows run
    row-major over each frame, units row-major inside a window (edge windows are smaller).
    Returns (unit order [num_units], cumulative window lengths in patches, int32)."""
    side = window_size // (merge * patch_size)
    if side < 1:
        raise ValueError(f"window_size {window_size} is smaller than one merge unit")
    order, counts, offset = [], [], 0
    for t, h, w in grid_thw.long().tolist():
        ids = _frame_window_ids(h // merge, w // merge, side)
        frame_order = torch.argsort(ids, stable=True)
        frame_counts = torch.bincount(ids)
        for _ in range(t):
            order.append(frame_order + offset)
            counts.append(frame_counts[frame_counts > 0])
            offset += ids.numel()
    lengths = torch.cat(counts) * merge**2
    return torch.cat(order), F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def _frame_window_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Window number of every merge unit of a rows x cols grid, in row-major unit order."""
    windows_per_row = -(-cols // side)
    r = torch.arange(rows)[:, None] // side
    c = torch.arange(cols)[None, :] // side
    return (r * windows_per_row + c).flatten()


def units_to_patches(unit_order: torch.Tensor, merge: int) -> torch.Tensor:
    """Expand an order of merge units to the order of their patches."""
    unit = merge**2
    return (unit_order[:, None] * unit + torch.arange(unit)).flatten()


class Qwen2_5_VisionMLP(nn.Module):
    """Gate and up projections merged column-parallel, act(gate) * up, down row-parallel."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPGroup, bias: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], tp, bias=bias)
        self.act = get_activation(act)
        self.down_proj = RowParallelLinear(hidden, dim, tp, bias=bias)

    def hidden_layers(self) -> tuple[MergedColumnParallelLinear, RowParallelLinear]:
        """The layers on either side of the hidden features: Qwen2.5-VL-7B's 3420 are padded
        on CUDA (vision/vit_common.py `pad_vision_mlps`)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, shard).chunk(2, dim=-1)
        return self.down_proj(self.act(gate).mul_(up), shard)  # act's output is new


def qwen2_5_block(cfg: VisionConfig, tp: TPGroup, ops: KernelOps) -> VisionBlock:
    """RMSNorm, gated MLP."""
    mlp = Qwen2_5_VisionMLP(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act, tp)
    return VisionBlock(cfg, tp, ops, lambda: RMSNorm(cfg.embed_dim, NORM_EPS, ops), mlp)


class Qwen2_5_VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__()
        check_heads(cfg.num_heads, tp)
        self.cfg = cfg
        self.tp = tp
        self.spatial_merge_size = cfg.spatial_merge_size
        self.out_hidden_size = cfg.out_hidden_size
        self.full_attention_blocks = frozenset(cfg.fullatt_block_indexes)
        self.patch_embed = VisionPatchEmbed(cfg.patch_dim, cfg.embed_dim)
        self.rotary = VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList(
            [qwen2_5_block(cfg, tp, ops) for _ in range(cfg.depth)]
        )
        norm = RMSNorm(cfg.embed_dim, NORM_EPS, ops)
        self.merger = VisionPatchMerger(
            norm, cfg.embed_dim, cfg.out_hidden_size, cfg.spatial_merge_size, tp
        )

    def forward(
        self, pixel_values: Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches / merge**2, out_hidden_size].

        `shard`: run this call tensor-parallel over that group on full weights (see vit_common)."""
        merge = self.spatial_merge_size
        units, cu_windows = window_index(grid_thw, self.cfg.window_size, self.cfg.patch_size, merge)
        patches = units_to_patches(units, merge)  # host order; indexes device rows as a copy
        x = self.patch_embed(pixel_values)[patches.to(self.device, non_blocking=True)]
        cos, sin = self.rotary(vision_position_ids(grid_thw, merge)[patches])
        # rotary tables and both segmentations: built once per call, shared by every block
        frames, windows = frame_segments(grid_thw, x.device), Segments.build(cu_windows, x.device)
        x = self._run_blocks(x, frames, windows, (cos, sin), shard)
        return self.merger(x, shard)[torch.argsort(units).to(self.device)]

    def _run_blocks(
        self,
        x: torch.Tensor,
        frames: Segments,
        windows: Segments,
        rotary: tuple[torch.Tensor, torch.Tensor],
        shard: TPGroup | None,
    ) -> torch.Tensor:
        # Window reordering keeps every frame contiguous, so frame boundaries still hold.
        for i, block in enumerate(self.blocks):
            segments = frames if i in self.full_attention_blocks else windows
            x = block(x, segments, rotary, shard)
        return x

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's `visual.` prefix; returns the loaded parameters."""
        return load_weights(self, weights, STACKED)
