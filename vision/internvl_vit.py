"""InternVL's vision side: the InternViT tower over image tiles, the pixel shuffle and the MLP
projector to the decoder's width, as one module (the composite's `visual`).

An item arrives as patch rows [tiles * side**2, C * patch * patch] with grid (tiles, side, side),
each tile's patches in row-major order (`video_processor.tile_patches`). Every tile gets a class
token in front and the learned position table added, and attends within itself only (one
attention segment of side**2 + 1 tokens per tile). A block is pre-norm attention and MLP whose
branch outputs are scaled per channel (`lambda_1`, `lambda_2`) before their residuals. The class
tokens are dropped at the end; each merge x merge window of a tile's patches is folded into one
row (the pixel shuffle: row-major windows, the window's patches row by row inside a row), and
the projector (LayerNorm, Linear, GELU, Linear) maps the rows to the decoder's width.

Sharded like the Qwen towers: q/k/v column-parallel by heads, the attention output and the MLP's
second layer row-parallel, the projector's first layer column- and its second row-parallel. A
head count the TP size does not divide (InternViT-6B's 25) is padded with zero heads up to the
next multiple: their q/k/v rows and output columns are zeros, so each attends to zeros and adds
nothing, and the outputs are exactly the unpadded tower's. The 6B tower's RMSNorm over the whole
q (and k) sums its squares over every rank's heads (one small all-reduce) and divides by the
real width, so padded zeros do not change it.
Built with a one-rank group (DP and auto mode) it holds full weights and issues no collective,
unless a call passes `shard` (then it runs tensor-parallel on that rank's slice of them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kernels.activation import get_activation
from kernels.attention.varlen import Segments
from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.layers.norm import LayerNorm, RMSNorm
from runtime.layers.weights import (
    LazyWeight,
    as_lazy,
    copy_checked,
    default_weight_loader,
    set_weight_loader,
)
from runtime.model_config import VisionConfig
from vision import vit_common as vit
from vision.vit_common import Pixels, TileTower, VisionMLP
from vision.vit_common import load_weights as load_into

# checkpoint names (relative to the tower) -> this module's
RENAMES = (
    ("embeddings.patch_embeddings.projection.", "patch_embed.proj."),
    ("embeddings.", ""),
    ("encoder.layer.", "layers."),
)
STACKED = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v")}


def replicated(*shape: int, fill: float = 0.0) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    return set_weight_loader(param, default_weight_loader)


def padded_heads(heads: int, tp: TPGroup) -> int:
    """The head count rounded up to a multiple of the TP size (zero heads fill the rest)."""
    return -(-heads // tp.size) * tp.size


def zero_padded(weight: LazyWeight | torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A checkpoint tensor with zeros appended along `dim` up to `size` (itself when it is
    that long already)."""
    tensor = as_lazy(weight).load()
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over `dim` features (q or k across all heads) held as `width` features (`dim`
    and its padded heads' zeros) split evenly over the ranks: each rank holds its slice of the
    weight; the squares are summed over the group and averaged over the `dim` real ones."""

    def __init__(self, dim: int, eps: float, tp: TPGroup, width: int | None = None):
        super().__init__()
        self.dim, self.eps, self.tp = dim, eps, tp
        self.width = width or dim
        self.local = self.width // tp.size
        self.weight = set_weight_loader(replicated(self.local, fill=1.0), self._load)

    def _load(self, param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
        full = zero_padded(weight, 0, self.width)
        copy_checked(param.data, full.narrow(0, self.tp.rank * self.local, self.local))

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        group, weight = self.tp, self.weight
        if shard is not None:  # full weights: this shard's slice
            group, size = shard, self.local // shard.size
            weight = weight.narrow(0, shard.rank * size, size)
        x32 = x.float()
        squares = group.all_reduce(x32.square().sum(-1, keepdim=True))
        normed = x32 * torch.rsqrt(squares / self.dim + self.eps)
        return weight * normed.to(x.dtype)


class InternAttention(nn.Module):
    """Merged q/k/v (checkpoint q_proj, k_proj, v_proj), optional RMSNorm over q and k, attention
    within each tile, row-parallel output projection; heads zero-padded to a multiple of the TP
    size (`padded_heads`)."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps):
        super().__init__()
        self.ops, self.head_dim = ops, cfg.head_dim
        dim, heads = cfg.embed_dim, padded_heads(cfg.num_heads, tp)
        self.width = heads * cfg.head_dim  # q's (k's, v's) features, padded heads included
        self.qkv = QKVParallelLinear(dim, cfg.head_dim, heads, heads, tp, bias=cfg.attention_bias)
        norms = [ShardedRMSNorm(dim, cfg.norm_eps, tp, self.width) for _ in range(2)]
        self.q_norm, self.k_norm = norms if cfg.qk_norm else (None, None)
        self.projection_layer = RowParallelLinear(self.width, dim, tp, bias=True)

    def forward(
        self, x: torch.Tensor, segments: Segments, shard: TPGroup | None = None
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, shard).chunk(3, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, shard), self.k_norm(k, shard)
        rows = x.shape[0]
        q, k, v = (t.reshape(rows, -1, self.head_dim) for t in (q, k, v))
        out = self.ops.varlen_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.projection_layer(out.reshape(rows, -1), shard)


def block_norm(cfg: VisionConfig, ops: KernelOps) -> nn.Module:
    if cfg.norm_type == "rms_norm":
        return RMSNorm(cfg.embed_dim, cfg.norm_eps, ops)
    return LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)


class InternBlock(nn.Module):
    """x + lambda_1 * attention(norm(x)), then the same with the MLP and lambda_2."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps):
        super().__init__()
        self.layernorm_before, self.layernorm_after = block_norm(cfg, ops), block_norm(cfg, ops)
        self.attention = InternAttention(cfg, tp, ops)
        names = ("fc1", "fc2")
        self.mlp = VisionMLP(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act, tp, names)
        self.lambda_1 = replicated(cfg.embed_dim, fill=1.0)
        self.lambda_2 = replicated(cfg.embed_dim, fill=1.0)

    def forward(
        self, x: torch.Tensor, segments: Segments, shard: TPGroup | None = None
    ) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x), segments, shard)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x), shard)


class InternProjector(nn.Module):
    """LayerNorm, Linear (column-parallel), GELU, Linear (row-parallel)."""

    def __init__(self, width: int, out_dim: int, tp: TPGroup):
        super().__init__()
        self.layer_norm = LayerNorm(width, eps=1e-5)
        self.linear_1 = ColumnParallelLinear(width, [out_dim], tp, bias=True)
        self.act = get_activation("gelu")
        self.linear_2 = RowParallelLinear(out_dim, out_dim, tp, bias=True)

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x), shard)), shard)


def pixel_shuffle(x: torch.Tensor, merge: int) -> torch.Tensor:
    """[tiles, side, side, C] -> [tiles * (side / merge)**2, merge**2 * C]: row-major windows of
    merge x merge patches, each window's patches concatenated row by row."""
    tiles, side, _, channels = x.shape
    cells = side // merge
    windows = x.reshape(tiles, cells, merge, cells, merge, channels).permute(0, 1, 3, 2, 4, 5)
    return windows.reshape(tiles * cells * cells, merge * merge * channels)


class InternVisionTransformer(TileTower):
    def __init__(self, cfg: VisionConfig, tp: TPGroup, ops: KernelOps = TORCH_OPS):
        super().__init__(cfg, tp)
        self.width = padded_heads(cfg.num_heads, tp) * cfg.head_dim
        dim = cfg.embed_dim
        self.cls_token = replicated(1, 1, dim)
        self.position_embeddings = replicated(1, self.side**2 + 1, dim)
        self.layers = nn.ModuleList([InternBlock(cfg, tp, ops) for _ in range(cfg.depth)])
        width = dim * cfg.spatial_merge_size**2
        self.multi_modal_projector = InternProjector(width, cfg.out_hidden_size, tp)

    def tiles(self, grid_thw: torch.Tensor) -> int:
        """The call's tile count; every grid must be whole tiles of the position table's size."""
        return vit.fixed_tiles(grid_thw, self.side, "InternViT")

    def forward(
        self, pixel_values: Pixels, grid_thw: torch.Tensor, shard: TPGroup | None = None
    ) -> torch.Tensor:
        """[tiles * side**2, patch_dim] -> [tiles * side**2 / merge**2, out_hidden_size]."""
        tiles, length = self.tiles(grid_thw), self.side**2 + 1
        patches = self.patch_embed(pixel_values).view(tiles, self.side**2, -1)
        cls = self.cls_token.expand(tiles, 1, -1)
        x = torch.cat((cls, patches), dim=1) + self.position_embeddings
        x = x.reshape(tiles * length, -1)
        segments = vit.tile_segments(tiles, length, x.device)
        for layer in self.layers:
            x = layer(x, segments, shard)
        grid = x.view(tiles, length, -1)[:, 1:].reshape(tiles, self.side, self.side, -1)
        return self.multi_modal_projector(pixel_shuffle(grid, self.spatial_merge_size), shard)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight | torch.Tensor]]) -> set[str]:
        """Names relative to the checkpoint's tower (`visual.` in the composite's layout, the
        projector under `multi_modal_projector.`); returns the loaded parameters. With padded
        heads, q/k/v rows and the output projection's columns get their zeros here."""
        renamed = ((rename(name), w) for name, w in weights)
        return load_into(self, ((name, self.padded(name, w)) for name, w in renamed), STACKED)

    def padded(self, name: str, weight: LazyWeight | torch.Tensor) -> LazyWeight | torch.Tensor:
        if self.width == self.cfg.embed_dim or ".attention." not in name:
            return weight
        if name.rsplit(".", 2)[-2] in STACKED:
            return zero_padded(weight, 0, self.width)
        if name.endswith("projection_layer.weight"):
            return zero_padded(weight, 1, self.width)
        return weight


def rename(name: str, renames: tuple[tuple[str, str], ...] = RENAMES) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name
