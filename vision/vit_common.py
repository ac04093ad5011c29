"""Parts shared by tessera's Qwen2-VL and Qwen2.5-VL vision towers.

Patches arrive flattened as [num_patches, C * tps * ps * ps] in the order the image processor
writes them: item by item, frame by frame, and inside a frame grouped by merge windows
(merge x merge neighbouring patches are consecutive). Attention never crosses a frame of one
item (nor, for windowed blocks, a window), described by cumulative sequence lengths `cu_seqlens`.

Every layer takes a `TPGroup`. With a one-rank group (DP mode, or no parallelism) the layers hold
full weights and issue no collective; with more ranks attention heads and MLP features are split.

A tower built with full weights also takes a per-call `shard` (a `TPGroup`, or None): with a
group, every parallel layer computes with that rank's slice of the full weights and the
row-parallel layers all-reduce over it, so one module runs either data- or tensor-parallel per
call (the auto encoder mode, vision/auto_encoder.py). With None it issues no collective at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import get_activation
from kernels.attention.varlen import Segments
from kernels.ops import TORCH_OPS, KernelOps
from runtime.distributed import TPGroup
from runtime.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    aligned_hidden_size,
    pad_hidden_features,
)
from runtime.layers.weights import LazyWeight, as_lazy, copy_checked, set_weight_loader
from runtime.model_config import VisionConfig

VISION_ROPE_THETA = 10000.0
Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) per patch


def check_heads(num_heads: int, tp: TPGroup) -> None:
    if num_heads % tp.size:
        raise ValueError(
            f"vision tower has {num_heads} attention heads, not divisible by TP size {tp.size}; "
            "use the DP vision encoder or a TP size that divides the head count"
        )


# ---------------------------------------------------------------- sequence bookkeeping


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths with one segment per frame of every item: [num_frames + 1] int32."""
    grid = grid_thw.long().cpu()
    lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def frame_segments(grid_thw: torch.Tensor, device: torch.device) -> Segments:
    """The frames as attention segments, prepared once per tower call for all its blocks."""
    return Segments.build(frame_cu_seqlens(grid_thw), device)


def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch in the processor's merge-window order: [num_patches, 2]."""
    out = []
    for t, h, w in grid_thw.long().tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
        pos = pos.reshape(h // merge, merge, w // merge, merge, 2).transpose(1, 2)
        out.append(pos.reshape(-1, 2).repeat(t, 1))
    return torch.cat(out)


def fixed_tiles(grid_thw: torch.Tensor, side: int, tower: str) -> int:
    """The call's tile (or image) count, for a tower that encodes fixed-size tiles of
    side x side patches: every grid must be whole such tiles (ValueError naming `tower`)."""
    grid = grid_thw.long().reshape(-1, 3)
    if bool((grid[:, 1:] != side).any()):
        raise ValueError(f"{tower} encodes tiles of {side}x{side} patches, got grids "
                         f"{grid.tolist()}")
    return int(grid[:, 0].sum())


def tile_segments(tiles: int, length: int, device: torch.device) -> Segments:
    """One attention segment of `length` tokens per tile."""
    return Segments.build(torch.arange(tiles + 1, dtype=torch.int32) * length, device)


# ---------------------------------------------------------------- patch embedding

# A call's pixels: one [patches, patch_dim] tensor, or one such block per item (in order)
Pixels = torch.Tensor | Sequence[torch.Tensor]


class VisionPatchEmbed(nn.Module):
    """A linear map of each flattened patch: the checkpoint's Conv3d, whose stride is its kernel,
    run as the one GEMM it equals.

    On CPU the GEMM is 4.5x faster than the convolution at width 64 and 6x at width 1280 (1024
    patches; docs/benchmarks.md). It sums in another order than transformers' Conv3d, so patch
    rows differ from it by float32 rounding (about 1e-6 relative); the parity tests take their
    oracle with the same GEMM and check the gap to the convolution separately."""

    def __init__(self, patch_dim: int, embed_dim: int, bias: bool = False):
        super().__init__()
        self.proj = ReplicatedLinear(patch_dim, embed_dim, bias=bias)
        set_weight_loader(self.proj.weight, self._load)

    @staticmethod
    def _load(param: nn.Parameter, weight: LazyWeight | torch.Tensor) -> None:
        # The conv kernel [embed, C, tps, ps, ps] flattens to the patch layout (C, t, y, x).
        tensor = as_lazy(weight).load()
        copy_checked(param.data, tensor.reshape(tensor.shape[0], -1), "patch_embed.proj.weight")

    @property
    def weight(self) -> torch.Tensor:
        return self.proj.weight

    def forward(self, pixels: Pixels) -> torch.Tensor:
        """[patches, patch_dim] -> [patches, embed_dim], on the weight's device and dtype.

        A list of row blocks (one per item) gives the rows of their concatenation, each block's
        GEMM writing into its slice of the output: the pixels are never copied into one tensor
        (a 448x448 image's are 4.8 MB, its embedding at width 64 a fifth of a MB)."""
        weight, bias = self.proj.weight, self.proj.bias
        if isinstance(pixels, torch.Tensor):
            return self.proj(pixels.to(device=weight.device, dtype=weight.dtype))
        rows = sum(block.shape[0] for block in pixels)
        out = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        start = 0
        for block in pixels:
            block = block.to(device=weight.device, dtype=weight.dtype)
            part = out[start : start + block.shape[0]]
            if weight.is_mkldnn:  # packed for oneDNN, which has no out= form
                part.copy_(self.proj(block))
            elif bias is None:
                torch.mm(block, weight.t(), out=part)
            else:  # the same kernel as F.linear with a bias
                torch.addmm(bias, block, weight.t(), out=part)
            start += block.shape[0]
        return out


# ---------------------------------------------------------------- 2-D rotary


class VisionRotary(nn.Module):
    """Rotary over the whole head: the first quarter of frequencies turn with the patch row, the
    second with the column, and the pair is repeated for the two rotate-half halves."""

    def __init__(self, head_dim: int, theta: float = VISION_ROPE_THETA):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"vision head_dim {head_dim} must be divisible by 4 (2-D rotary)")
        half = head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32) / half
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [N, 2] -> (cos, sin), each [N, head_dim] in float32."""
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        angles = freqs.flatten(1)  # [N, head_dim / 2]: row frequencies, then column ones
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """Merged QKV (column-parallel by heads), 2-D rotary, segment attention, row-parallel proj."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        tp: TPGroup,
        ops: KernelOps = TORCH_OPS,
        biases: tuple[bool, bool] = (True, True),
    ):
        """`biases`: whether qkv and proj have a bias (GLM-4.1V's tower: neither, by default)."""
        super().__init__()
        check_heads(num_heads, tp)
        self.ops = ops
        self.head_dim = embed_dim // num_heads
        self.local_heads = num_heads // tp.size
        self.scale = self.head_dim**-0.5
        qkv_bias, proj_bias = biases
        self.qkv = QKVParallelLinear(
            embed_dim, self.head_dim, num_heads, num_heads, tp, bias=qkv_bias
        )
        self.proj = RowParallelLinear(embed_dim, embed_dim, tp, bias=proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        segments: Segments,
        rotary: tuple[torch.Tensor, torch.Tensor],
        shard: TPGroup | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x, shard)
        q, k, v = qkv.view(x.shape[0], 3, -1, self.head_dim).unbind(1)
        cos, sin = rotary
        q, k = self.ops.apply_rotary_qk(q, k, cos, sin)
        out = self.ops.varlen_attention(q, k, v, segments, self.scale)
        return self.proj(out.reshape(x.shape[0], -1), shard)


# ---------------------------------------------------------------- patch merger


class VisionPatchMerger(nn.Module):
    """Normalise each patch, concatenate merge x merge neighbours, then a two-layer GELU MLP."""

    def __init__(self, norm: nn.Module, embed_dim: int, out_dim: int, merge: int, tp: TPGroup):
        super().__init__()
        self.hidden = embed_dim * merge**2
        self.ln_q = norm
        self.mlp = nn.ModuleList(
            [
                ColumnParallelLinear(self.hidden, [self.hidden], tp, bias=True),
                nn.GELU(),
                RowParallelLinear(self.hidden, out_dim, tp, bias=True),
            ]
        )

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.hidden)
        fc1, act, fc2 = self.mlp
        return fc2(act(fc1(x, shard)), shard)


# ---------------------------------------------------------------- weight loading


def load_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, LazyWeight | torch.Tensor]],
    stacked: Mapping[str, tuple[str, int]] | None = None,
) -> set[str]:
    """Give each checkpoint tensor to its parameter's weight_loader; returns the parameter names.

    `stacked` maps a checkpoint module name to (merged module name, shard id), e.g.
    {"gate_proj": ("gate_up_proj", 0)} for parameters that hold several checkpoint tensors."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, weight in weights:
        target, shard = _checkpoint_target(name, stacked or {})
        if target not in params:
            raise KeyError(
                f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}"
            )
        _load_one(params[target], weight, shard)
        loaded.add(target)
    return loaded


def _checkpoint_target(name: str, stacked: Mapping[str, tuple[str, int]]) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in stacked:
            merged, shard = stacked[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), shard
    return name, None


def _load_one(param: nn.Parameter, weight: LazyWeight | torch.Tensor, shard: int | None) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_checked(param.data, as_lazy(weight).load())
    elif shard is None:
        loader(param, weight)
    else:
        loader(param, weight, shard)


class VisionMLP(nn.Module):
    """Column-parallel in, activation, row-parallel out. `names`: the two layers' checkpoint
    names (Qwen2-VL `fc1`/`fc2`, Qwen3-VL `linear_fc1`/`linear_fc2`)."""

    def __init__(self, dim: int, hidden: int, act: str, tp: TPGroup, names: tuple[str, str]):
        super().__init__()
        self.names = names
        setattr(self, names[0], ColumnParallelLinear(dim, [hidden], tp, bias=True))
        self.act = get_activation(act)
        setattr(self, names[1], RowParallelLinear(hidden, dim, tp, bias=True))

    def hidden_layers(self) -> tuple[ColumnParallelLinear, RowParallelLinear]:
        """The layers on either side of the hidden features (what `pad_vision_mlps` pads)."""
        return getattr(self, self.names[0]), getattr(self, self.names[1])

    def forward(self, x: torch.Tensor, shard: TPGroup | None = None) -> torch.Tensor:
        up, down = self.hidden_layers()
        return down(self.act(up(x, shard)), shard)


def pad_vision_mlps(tower: nn.Module, shard_size: int = 1) -> int:
    """Zero-pad the hidden size of every MLP in `tower` whose GEMM rows (or a shard's slice of
    them) are not 16-byte aligned, once the weights are loaded; returns how many were padded.
    The outputs are exactly the same (runtime/layers/linear.py `pad_hidden_features`).

    Why: Qwen2.5-VL-7B's tower MLP has 3420 hidden features; its bfloat16 activation rows of
    6840 bytes keep cuBLAS on Hopper off its TMA GEMMs (the tower ran at 39% of its bf16 FLOP
    floor on an H200). Padded to 3456, the MLP took 917 instead of 1408 us for 16k patches on an
    H200 (bf16), and the 32-block tower with torch attention 103 instead of 117 ms for four
    images of 64x64 patches; a tp 2 shard's 1710 -> 1728 and a tp 4 shard's 855 -> 896 MLP
    gained 2.6x and 3.1x.
    `shard_size`: the largest group a call passes as `shard=` (auto encoder mode: the TP size),
    so that every shard's slice is aligned as well.

    `build_model` calls it on CUDA only (vision/vlm.py; `pad_vit_mlp=False`, or the server's
    `--disable-vit-mlp-padding`, turns it off): on a CPU the extra features would only cost
    FLOPs (and float32 rows are aligned anyway)."""
    mlps = [m for m in tower.modules() if callable(getattr(m, "hidden_layers", None))]
    padded = 0
    for up, down in (mlp.hidden_layers() for mlp in mlps):
        size = aligned_hidden_size(down.local_in, down.weight.element_size(), shard_size)
        if size != down.local_in:
            pad_hidden_features(up, down, size)
            padded += 1
    return padded


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP, each with its residual; every tower picks its norm and MLP."""

    def __init__(
        self,
        cfg: VisionConfig,
        tp: TPGroup,
        ops: KernelOps,
        norm: Callable[[], nn.Module],
        mlp: nn.Module,
        attn_biases: tuple[bool, bool] = (True, True),
    ):
        super().__init__()
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(cfg.embed_dim, cfg.num_heads, tp, ops, attn_biases)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, segments: Segments, rotary: Rotary,
                shard: TPGroup | None = None) -> torch.Tensor:
        # Each branch ends in a biased projection (a new tensor): the residual is added into it.
        x = self.attn(self.norm1(x), segments, rotary, shard).add_(x)
        return self.mlp(self.norm2(x), shard).add_(x)


# Frames of 16x16 to 48x48 patches, and 4 frames of 16x16 (the patches of one 32x32 frame with a
# quarter of its attention pairs): more probes than unknowns, so one noisy timing is outvoted
# when the call, per-patch and per-pair costs are told apart.
FRAME_PROBES = ((1, 16, 16), (1, 32, 32), (4, 16, 16), (1, 48, 48), (2, 32, 32))
TILE_PROBES = (1, 2, 3, 4, 6)  # tile counts, for a tower of one fixed tile size


class VisionTower(nn.Module):
    """What every vision tower shares: its dtype and device are those of its patch embedding,
    and the grids the auto encoder mode's start-up calibration times it on."""

    patch_embed: nn.Module

    def calibration_grids(self) -> tuple[tuple[int, int, int], ...]:
        """(t, h, w) grids in patches this tower encodes, for the start-up calibration
        (vision/encoder_calibration.py): frames of any size by default. A tower of fixed-size
        tiles returns whole tiles (`tile_probes`)."""
        return FRAME_PROBES

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device


def tile_probes(side: int) -> tuple[tuple[int, int, int], ...]:
    """Calibration grids for a tower that encodes tiles of `side` x `side` patches only: its
    items' work is their tile count, so the probes count tiles."""
    return tuple((n, side, side) for n in TILE_PROBES)


class TileTower(VisionTower):
    """A tower over fixed-size square tiles (InternViT, SigLIP): its config and group, merge
    window, output width, patches per tile side and the patch embedding (with a bias); its
    calibration probes count tiles. Each tower checks (or pads) its own head count."""

    def __init__(self, cfg: VisionConfig, tp: TPGroup):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.spatial_merge_size = cfg.spatial_merge_size
        self.out_hidden_size = cfg.out_hidden_size
        self.side = cfg.image_size // cfg.patch_size  # patches per tile side
        self.patch_embed = VisionPatchEmbed(cfg.patch_dim, cfg.embed_dim, bias=True)

    def calibration_grids(self) -> tuple[tuple[int, int, int], ...]:
        return tile_probes(self.side)
