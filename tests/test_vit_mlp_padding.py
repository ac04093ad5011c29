"""Zero-padding of the vision towers' MLP hidden size (runtime/layers/linear.py
`pad_hidden_features`, vision/vit_common.py `pad_vision_mlps`): the same outputs, whole or run as
`shard=` slices or as TP ranks, shapes a GPU's GEMMs align on, and only on CUDA in build_model.

The MLPs here have 108 hidden features (Qwen2.5-VL-7B's 3420 scaled down): rows of 216 bytes in
bfloat16, not a multiple of 16, so the bfloat16 rule pads them to 128 (256 for shards of 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from numerics import assert_within_rounding, vision_terms
from torch import nn

import runtime.tiny_checkpoint as mtc
from runtime.distributed import TPGroup
from runtime.families import qwen2_5_vl
from runtime.layers.linear import RowParallelLinear, aligned_hidden_size, pad_hidden_features
from runtime.model_config import VisionConfig
from runtime.server_args import ServerArgs
from vision.qwen2_5_vl_vit import Qwen2_5_VisionMLP, Qwen2_5_VisionTransformer
from vision.vit_common import VisionMLP, pad_vision_mlps
from vision.vlm import build_model

DIM, HIDDEN = 32, 108
BF16 = torch.bfloat16.itemsize


class SumGroup(TPGroup):
    """A rank of a group whose collectives are the identity: each rank's partial result."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _mlp(kind: str, tp: TPGroup = TPGroup()) -> nn.Module:
    if kind == "gated":
        return Qwen2_5_VisionMLP(DIM, HIDDEN, "silu", tp)
    return VisionMLP(DIM, HIDDEN, "gelu_pytorch_tanh", tp, ("linear_fc1", "linear_fc2"))


@torch.no_grad()
def _filled(module: nn.Module, seed: int = 0) -> nn.Module:
    """Unit-scale activations and nonzero biases, so a misplaced row shows."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(0.5 * noise if p.dim() == 1 else noise / p[0].numel() ** 0.5)
    return module


def _sharded(mlp: nn.Module, x: torch.Tensor, size: int) -> torch.Tensor:
    """The sum of every rank's `shard=` result (down's bias counted once)."""
    bias = mlp.hidden_layers()[1].bias
    parts = [mlp(x, SumGroup(rank=r, size=size)) - bias for r in range(size)]
    return torch.stack(parts).sum(0) + bias


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, hidden: int) -> None:
    assert expected.abs().max() > 0.5, "outputs too small to show a misplaced row"
    assert_within_rounding(actual, expected, DIM + hidden + 2)


@pytest.mark.parametrize(
    ("size", "itemsize", "shard", "want"),
    [
        (3420, BF16, 1, 3456),  # Qwen2.5-VL-7B, one rank or DP
        (3420, BF16, 2, 3456),  # auto mode at tp 2: 1728 per shard
        (3420, BF16, 4, 3584),  # 896 per shard
        (3420, BF16, 8, 3584),  # 448 per shard
        (1710, BF16, 1, 1728),  # TP mode, tp 2: one rank's share
        (855, BF16, 1, 896),  # TP mode, tp 4
        (3420, 4, 1, 3420),  # float32 rows of 13680 bytes are aligned
        (4304, BF16, 1, 4304),  # Qwen3-VL-8B: 8608-byte rows are aligned
        (4304, BF16, 2, 4304),
        (4304, BF16, 4, 4352),  # 1076 per shard is not
        (5120, BF16, 8, 5120),  # Qwen2-VL
    ],
)
def test_aligned_hidden_size(size: int, itemsize: int, shard: int, want: int) -> None:
    got = aligned_hidden_size(size, itemsize, shard)
    assert got == want
    slice_ = got // shard
    assert got % shard == 0 and (slice_ * itemsize % 16 == 0)
    assert got == size or slice_ % 64 == 0


@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_padded_mlp_computes_the_same_with_zeros_in_place(kind: str) -> None:
    mlp = _filled(_mlp(kind))
    up, down = mlp.hidden_layers()
    parts = len(up.local_sizes)
    before = [w.clone() for w in (up.weight, up.bias, down.weight, down.bias)]
    x = torch.randn(7, DIM)
    with torch.inference_mode():
        want = mlp(x)
    pad_hidden_features(up, down, 128)
    assert up.local_sizes == [128] * parts and down.local_in == 128
    assert up.weight.shape == (128 * parts, DIM) and up.bias.shape == (128 * parts,)
    assert down.weight.shape == (DIM, 128)
    for i in range(parts):  # each part keeps its rows first, then 20 zero rows
        for new, old in ((up.weight, before[0]), (up.bias, before[1])):
            assert torch.equal(new[128 * i : 128 * i + HIDDEN], old[HIDDEN * i : HIDDEN * (i + 1)])
            assert not new[128 * i + HIDDEN : 128 * (i + 1)].any()
    assert torch.equal(down.weight[:, :HIDDEN], before[2]) and not down.weight[:, HIDDEN:].any()
    assert torch.equal(down.bias, before[3])
    with torch.inference_mode():
        _assert_same(mlp(x), want, 128)


@pytest.mark.parametrize("kind", ["gated", "plain"])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_shard_slices_of_a_padded_mlp(kind: str, shards: int) -> None:
    """Full weights padded for shards of `shards`: every shard's slice is 64-aligned and the
    shards' results still add up to the unpadded MLP's (shard copies made before are dropped)."""
    mlp = _filled(_mlp(kind))
    x = torch.randn(5, DIM)
    with torch.inference_mode():
        want = mlp(x)
        _sharded(mlp, x, shards)  # makes (and keeps) shard copies of the unpadded weights
    size = aligned_hidden_size(HIDDEN, BF16, shards)
    assert size == (256 if shards == 4 else 128)
    pad_hidden_features(*mlp.hidden_layers(), size)
    up, down = mlp.hidden_layers()
    for r in range(shards):
        group = SumGroup(rank=r, size=shards)
        assert up.shard_weights(group)[0].shape[0] == len(up.local_sizes) * size // shards
        assert down.shard_weights(group).shape[1] == size // shards
        assert size // shards % 64 == 0
    with torch.inference_mode():
        _assert_same(_sharded(mlp, x, shards), want, size)


@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_tp_ranks_pad_their_own_share(kind: str) -> None:
    """TP mode: each of 2 ranks loads 54 hidden features and pads them to 64; their partial
    results still add up to the unpadded full MLP's."""
    full = _filled(_mlp(kind))
    x = torch.randn(6, DIM)
    params = dict(full.named_parameters())
    partials = []
    for r in range(2):
        rank = _mlp(kind, SumGroup(rank=r, size=2))
        for name, p in rank.named_parameters():
            p.weight_loader(p, params[name])
        up, down = rank.hidden_layers()
        pad_hidden_features(up, down, aligned_hidden_size(down.local_in, BF16))
        assert down.local_in == 64 and down.weight.shape == (DIM, 64)
        with torch.inference_mode():
            partials.append(rank(x) - down.bias)
    with torch.inference_mode():
        _assert_same(torch.stack(partials).sum(0) + full.hidden_layers()[1].bias, full(x), 128)


def test_pad_refuses_what_it_cannot_keep_exact() -> None:
    mlp = _mlp("gated")
    up, down = mlp.hidden_layers()
    with pytest.raises(ValueError, match="cannot pad"):
        pad_hidden_features(up, down, HIDDEN - 1)
    with pytest.raises(ValueError, match="hidden features"):  # not the layer that reads up's
        pad_hidden_features(up, RowParallelLinear(HIDDEN - 8, DIM, TPGroup()), 128)


def _tower_config(hidden: int = HIDDEN) -> VisionConfig:
    return VisionConfig(
        depth=2, embed_dim=DIM, num_heads=2, intermediate_size=hidden, out_hidden_size=48,
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
        hidden_act="silu", window_size=56, fullatt_block_indexes=(1,),
    )


def test_padded_qwen2_5_tower_gives_the_same_embeddings() -> None:
    cfg = _tower_config()
    tower = _filled(Qwen2_5_VisionTransformer(cfg, TPGroup()).eval(), seed=1)
    grid = torch.tensor([[1, 8, 12], [2, 6, 10]])  # whole and ragged windows, two frames
    pixels = torch.randn(int(grid.prod(dim=1).sum()), cfg.patch_dim)
    with torch.inference_mode():
        want = tower(pixels, grid)
    assert pad_vision_mlps(tower) == 0  # float32 rows of 432 bytes: already aligned
    for block in tower.blocks:
        pad_hidden_features(*block.mlp.hidden_layers(), 128)
    with torch.inference_mode():
        got = tower(pixels, grid)
    assert want.abs().max() > 0.1
    assert_within_rounding(got, want, vision_terms(cfg, 120) + 128 - HIDDEN)


def test_pad_vision_mlps_pads_bf16_blocks_not_the_merger() -> None:
    tower = Qwen2_5_VisionTransformer(_tower_config(), TPGroup()).to(torch.bfloat16)
    merger = [p.shape for p in tower.merger.parameters()]
    assert pad_vision_mlps(tower, shard_size=4) == 2
    for block in tower.blocks:
        up, down = block.mlp.hidden_layers()
        assert up.local_sizes == [256, 256] and down.weight.shape == (DIM, 256)
    assert [p.shape for p in tower.merger.parameters()] == merger
    assert pad_vision_mlps(tower, shard_size=4) == 0  # aligned now


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL checkpoint whose tower MLP has 108 hidden features."""
    key = "tiny"
    shape = dict(qwen2_5_vl.VISION_SHAPES[key], intermediate_size=HIDDEN)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(qwen2_5_vl.VISION_SHAPES, key, shape)
        return mtc.make_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("pad") / "ck")


def _hidden_sizes(model: nn.Module) -> set[int]:
    return {block.mlp.hidden_layers()[1].weight.shape[1] for block in model.visual.blocks}


def test_build_model_does_not_pad_on_cpu(folder: Path) -> None:
    model = build_model(str(folder), TPGroup(), dtype="bfloat16", cpu_linear="aten")
    assert _hidden_sizes(model) == {HIDDEN}
    assert pad_vision_mlps(model.visual) == len(model.visual.blocks)  # it would on CUDA


def test_the_server_flag_reaches_build_model(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scheduler.process  # zmq: imported only by the test that needs it

    seen: dict[str, Any] = {}
    monkeypatch.setattr(scheduler.process, "build_model", lambda *a, **kw: seen.update(kw))
    for flags, pad in (([], True), (["--disable-vit-mlp-padding"], False)):
        args = ServerArgs.from_cli(["--model-path", str(folder), "--device", "cpu", *flags])
        scheduler.process.load_model(args, TPGroup())
        assert seen["pad_vit_mlp"] is pad


@pytest.mark.gpu
def test_build_model_pads_on_cuda_unless_told_not_to(folder: Path) -> None:
    padded = build_model(str(folder), TPGroup(), dtype="bfloat16", device="cuda")
    plain = build_model(str(folder), TPGroup(), dtype="bfloat16", device="cuda", pad_vit_mlp=False)
    assert _hidden_sizes(padded) == {128} and _hidden_sizes(plain) == {HIDDEN}
    grid = torch.tensor([[1, 8, 12]])
    pixels = torch.randn(96, padded.config.vision.patch_dim, device="cuda")
    with torch.inference_mode():
        got, want = padded.visual([pixels], grid), plain.visual([pixels], grid)
    assert want.abs().max() > 0.1  # bfloat16 roundings apart, not a misplaced row apart
    assert (got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max()
