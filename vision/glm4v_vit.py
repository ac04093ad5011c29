"""The GLM-4.1V vision tower: RMSNorm ViT blocks with 2-D rotary attention and gated MLPs, a
learned position table interpolated to every grid, and a downsampling merger.

- Patch embedding (the checkpoint's Conv3d, with bias, run as one GEMM), then an RMSNorm
  (`post_conv_layernorm`), then the learned [side x side] position table sampled bicubically at
  each patch's centre, (row + 0.5) / h and (col + 0.5) / w of its item's patch grid (corners not
  aligned, edges clamped), in float32, as transformers' `grid_sample` call does.
- Blocks: RMSNorm, attention without biases, a gated SiLU MLP without biases whose hidden size is
  the tower's `out_hidden_size`.
- After the last RMSNorm (`post_layernorm`), each merge x merge window of patches goes through
  `downsample` (the checkpoint's Conv2d whose stride is its kernel: one GEMM over the window's
  concatenated patches) to `out_hidden_size`, then the merger: a linear map, LayerNorm, GELU and
  a gated MLP of `intermediate_size` hidden features.

Built with the rank's `TPGroup` for TP mode, or a one-rank `TPGroup()` for DP and auto mode (full
weights; a call's `shard` group then runs it tensor-parallel). The blocks and the merger's gated
MLP are split over ranks; the position table, `downsample` and the merger's first linear map are
replicated (local, no collective).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import ReplicatedLinear
from runtime.layers.norm import LayerNorm, RMSNorm
from runtime.layers.weights import (
    LazyWeight,
    as_lazy,
    copy_checked,
    default_weight_loader,
    set_weight_loader,
)
from runtime.model_config import VisionConfig
from vision import vit_common as vc
from vision.qwen2_5_vl_vit import STACKED, Qwen2_5_VisionMLP

MERGER_NORM_EPS = 1e-5  # the merger's LayerNorm keeps torch's default


def table_grid(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """Where every patch samples the position table, in `grid_sample`'s [-1, 1] coordinates
    (x = column, y = row), in the processor's merge-window order: [N, 2] float32. Pure."""
    grid = grid_thw.long().cpu()
    rowcol = vc.vision_position_ids(grid, merge)
    counts = grid.prod(dim=1)
    sizes = torch.repeat_interleave(grid[:, 1:], counts, dim=0).to(torch.float32)
    norm = ((rowcol + 0.5) / sizes) * 2 - 1
    return norm.flip(-1)


def glm4v_block(cfg: VisionConfig, tp: TPGroup, ops: KernelOps) -> vc.VisionBlock:
    """RMSNorm, attention without biases, gated MLP (no bias) of out_hidden_size features."""
    mlp = Qwen2_5_VisionMLP(cfg.embed_dim, cfg.out_hidden_size, cfg.hidden_act, tp, bias=False)
    norm = lambda: RMSNorm(cfg.embed_dim, cfg.norm_eps, ops)  # noqa: E731
    return vc.VisionBlock(cfg, tp, ops, norm, mlp, (cfg.attention_bias, False))


class Glm4vPatchMerger(Qwen2_5_VisionMLP):
    """A replicated linear map, LayerNorm and GELU before the gated MLP (split over ranks)."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup):
        dim = cfg.out_hidden_size
        super().__init__(dim, cfg.intermediate_size, cfg.hidden_act, tp, bias=False)
        self.proj = ReplicatedLinear(dim, dim, bias=False)
        self.post_projection_norm = LayerNorm(dim, eps=MERGER_NORM_EPS)

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return super().forward(x, shard)


class Glm4vVisionTransformer(vc.VisionTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__()
        vc.check_heads(cfg.num_heads, tp)
        self.cfg = cfg
        self.tp = tp
        self.spatial_merge_size = merge = cfg.spatial_merge_size
        self.out_hidden_size = cfg.out_hidden_size
        self.side = cfg.image_size // cfg.patch_size
        self.patch_embed = vc.VisionPatchEmbed(cfg.patch_dim, cfg.embed_dim, bias=True)
        self.post_conv_layernorm = RMSNorm(cfg.embed_dim, cfg.norm_eps, ops)
        table = nn.Embedding(self.side**2, cfg.embed_dim)  # published as embeddings.*
        table.weight.requires_grad_(False)
        set_weight_loader(table.weight, default_weight_loader)
        self.embeddings = nn.ModuleDict({"position_embedding": table})
        self.rotary = vc.VisionRotary(cfg.head_dim)
        self.blocks = nn.ModuleList([glm4v_block(cfg, tp, ops) for _ in range(cfg.depth)])
        self.post_layernorm = RMSNorm(cfg.embed_dim, cfg.norm_eps, ops)
        window = cfg.embed_dim * merge**2
        self.downsample = ReplicatedLinear(window, cfg.out_hidden_size, bias=True)
        set_weight_loader(self.downsample.weight, self._load_downsample)
        self.merger = Glm4vPatchMerger(cfg, tp)

    @staticmethod
    def _load_downsample(param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
        # The Conv2d kernel [out, C, m, m] over a window whose patches are rows (i, j) of C.
        kernel = as_lazy(weight).load()
        rows = kernel.permute(0, 2, 3, 1).reshape(kernel.shape[0], -1)
        copy_checked(param.data, rows, "downsample.weight")

    def forward(
        self, pixel_values: vc.Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches / merge**2, out_hidden_size].

        `shard`: run this call tensor-parallel over that group on full weights (see vit_common)."""
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        x = x + self.positions(grid_thw).to(x.dtype)
        rotary = self.rotary(vc.vision_position_ids(grid_thw, self.spatial_merge_size))
        segments = vc.frame_segments(grid_thw, x.device)  # rotary and segments: once per call
        for block in self.blocks:
            x = block(x, segments, rotary, shard)
        x = self.post_layernorm(x).reshape(-1, self.downsample.weight.shape[1])
        return self.merger(self.downsample(x), shard)

    def positions(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The position table sampled at every patch: [num_patches, embed_dim] float32."""
        weight = self.embeddings["position_embedding"].weight
        table = weight.float().reshape(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = table_grid(grid_thw, self.spatial_merge_size).to(weight.device)
        sampled = F.grid_sample(
            table, grid[None, :, None, :], mode="bicubic", align_corners=False,
            padding_mode="border",
        )  # [1, embed_dim, N, 1]
        return sampled[0, :, :, 0].T

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's `visual.` prefix; returns the loaded parameters."""
        return vc.load_weights(self, weights, STACKED)
