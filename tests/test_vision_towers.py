"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers against transformers, and TP shards against one
rank. Qwen3-VL rows hold the main embedding and then every DeepStack level.

transformers is imported only in the pytest process (it is slow to import); the spawned TP ranks
load the tower weights from a temporary .pt file written by the parent.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_on_ranks
from numerics import assert_within_rounding, vision_terms

from kernels.attention.varlen import varlen_attention
from runtime.distributed import TPGroup
from runtime.model_config import ModelConfig, VisionConfig
from vision.dp_encoder import frame_units
from vision.qwen2_5_vl_vit import Qwen2_5_VisionTransformer, window_index
from vision.qwen2_vl_vit import Qwen2VisionTransformer
from vision.qwen3_vl_vit import Qwen3VisionTransformer, position_table_taps
from vision.vit_common import vision_position_ids

TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    image_token_id=500,
    video_token_id=501,
    vision_start_token_id=502,
    vision_end_token_id=503,
    bos_token_id=504,
    eos_token_id=505,
)
CONFIGS = {
    "qwen2_vl": dict(
        TEXT,
        architectures=["Qwen2VLForConditionalGeneration"],
        model_type="qwen2_vl",
        vision_config=dict(
            depth=2,
            embed_dim=64,
            num_heads=4,
            mlp_ratio=2,
            hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
            hidden_act="quick_gelu",
        ),
    ),
    "qwen2_5_vl": dict(
        TEXT,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        vision_config=dict(
            depth=2,
            hidden_size=64,
            num_heads=4,
            intermediate_size=128,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            tokens_per_second=2,
            hidden_act="silu",
            in_chans=3,
        ),
    ),
    "qwen3_vl": dict(  # nested: transformers' Qwen3-VL config takes no flat text fields
        {k: v for k, v in TEXT.items() if k.endswith("token_id")},
        text_config=dict(
            TEXT,
            head_dim=16,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                          "mrope_interleaved": True},
        ),
        architectures=["Qwen3VLForConditionalGeneration"],
        model_type="qwen3_vl",
        vision_config=dict(
            depth=3,
            hidden_size=64,
            num_heads=4,
            intermediate_size=128,
            out_hidden_size=64,
            num_position_embeddings=36,
            deepstack_visual_indexes=[0, 1],
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            hidden_act="gelu_pytorch_tanh",
            in_channels=3,
        ),
    ),
}
TOWERS = {
    "qwen2_vl": Qwen2VisionTransformer,
    "qwen2_5_vl": Qwen2_5_VisionTransformer,
    "qwen3_vl": Qwen3VisionTransformer,
}
COMMON_GRIDS = [[(1, 4, 4)], [(1, 4, 4), (1, 6, 8)], [(2, 4, 6)]]
GRIDS = {
    "qwen2_vl": COMMON_GRIDS,
    # The 6x6 position table is resampled down, to its own size and up.
    "qwen3_vl": COMMON_GRIDS + [[(1, 6, 6), (1, 10, 14)], [(1, 2, 2)]],
    # Windows of 4x4 patches: (1, 8, 12) splits evenly, (1, 6, 10) leaves ragged edge windows.
    "qwen2_5_vl": COMMON_GRIDS + [[(1, 8, 12)], [(1, 6, 10)], [(1, 8, 12), (2, 6, 10)]],
}


# ---------------------------------------------------------------- helpers


def vision_config(arch: str) -> VisionConfig:
    return ModelConfig.from_dict(CONFIGS[arch]).vision


def make_inputs(cfg: VisionConfig, grids: list[tuple[int, int, int]], seed: int) -> dict:
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return {
        "pixels": torch.randn(n, cfg.patch_dim, generator=gen),
        "grid": torch.tensor(grids, dtype=torch.long),
    }


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations, so differences are not hidden by tiny outputs."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name or "ln_q" in name:
            p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
        elif p.dim() == 1:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / p[0].numel() ** 0.5)


def build_tower(arch: str, state: dict[str, torch.Tensor], tp: TPGroup) -> torch.nn.Module:
    tower = TOWERS[arch](vision_config(arch), tp).eval()
    loaded = tower.load_weights(state.items())
    assert loaded == {name for name, _ in tower.named_parameters()}
    return tower


def run_cases(tower: torch.nn.Module, cases: list[dict]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [tower(case["pixels"], case["grid"]) for case in cases]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, cfg: VisionConfig, grid: torch.Tensor
                 ) -> float:
    """Two computations of the same tower outputs that round differently (other summation
    orders, batch shapes, TP splits): within the rounding bound of the tower's sum lengths,
    attention spanning at most the largest item's patches."""
    assert ref.abs().max() > 0.1, "reference output too small to be a meaningful check"
    return assert_within_rounding(ours, ref, vision_terms(cfg, int(grid.prod(dim=1).max())))


# ---------------------------------------------------------------- transformers oracle


def _hf_model(arch: str) -> torch.nn.Module:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    classes = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    }
    config_cls, model_cls = classes[arch]
    return model_cls(config_cls(**CONFIGS[arch])).eval()


def hf_rows(visual: torch.nn.Module, case: dict) -> torch.Tensor:
    """transformers' merged output, then its DeepStack levels (Qwen3-VL) along the features."""
    out = visual(case["pixels"], grid_thw=case["grid"])
    levels = getattr(out, "deepstack_features", None) or []
    return torch.cat([out.pooler_output, *levels], dim=-1)


@pytest.fixture(scope="module")
def oracle() -> dict[str, dict[str, Any]]:
    """Per arch: the tower's checkpoint tensors (published names), the cases, HF outputs."""
    out = {}
    for seed, arch in enumerate(CONFIGS):
        visual = _hf_model(arch).model.visual
        randomize(visual, seed)
        cfg = vision_config(arch)
        cases = [make_inputs(cfg, grids, seed=10 * seed + i) for i, grids in enumerate(GRIDS[arch])]
        with torch.inference_mode():
            refs = [hf_rows(visual, c) for c in cases]
        state = {k: v.clone() for k, v in visual.state_dict().items()}
        out[arch] = {"state": state, "cases": cases, "refs": refs}
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_tower_matches_transformers(arch: str, oracle: dict) -> None:
    data = oracle[arch]
    tower = build_tower(arch, data["state"], TPGroup())
    diffs = []
    for case, out, ref in zip(data["cases"], run_cases(tower, data["cases"]), data["refs"]):
        merge = tower.spatial_merge_size**2
        assert out.shape == (case["pixels"].shape[0] // merge, tower.out_hidden_size)
        # both sides round the same sums in other orders: see assert_close
        diffs.append(assert_close(out, ref, tower.cfg, case["grid"]))
    assert tower.dtype == torch.float32
    print(f"{arch}: max abs diff vs transformers per case {diffs}")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_items_are_independent(arch: str, oracle: dict) -> None:
    """A batch of items equals each item encoded alone (what the DP encoder relies on)."""
    tower = build_tower(arch, oracle[arch]["state"], TPGroup())
    cfg = vision_config(arch)
    grids = [(1, 8, 12), (2, 4, 6), (1, 6, 10)]
    batch = make_inputs(cfg, grids, seed=7)
    sizes = [t * h * w for t, h, w in grids]
    alone = [
        {"pixels": px, "grid": torch.tensor([g])}
        for px, g in zip(batch["pixels"].split(sizes), grids)
    ]
    together = run_cases(tower, [batch])[0]
    # other GEMM shapes, so other summation orders: see assert_close
    assert_close(together, torch.cat(run_cases(tower, alone)), cfg, batch["grid"])


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_pixels_as_item_blocks_equal_their_concatenation(arch: str, oracle: dict) -> None:
    """The tower takes a call's pixels as one block per item (how the scheduler passes them, so
    they are never copied into one tensor): the same output, bit for bit, as the joined pixels.
    Qwen3-VL's patch embedding has a bias (the addmm path), the others none."""
    tower = build_tower(arch, oracle[arch]["state"], TPGroup())
    grids = [(1, 8, 12), (2, 4, 6), (1, 6, 10)]
    batch = make_inputs(vision_config(arch), grids, seed=5)
    blocks = list(batch["pixels"].split([t * h * w for t, h, w in grids]))
    with torch.inference_mode():
        joined = tower(batch["pixels"], batch["grid"])
        assert torch.equal(tower(blocks, batch["grid"]), joined)
        assert torch.equal(tower.patch_embed(blocks), tower.patch_embed(batch["pixels"]))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_frames_are_independent(arch: str, oracle: dict) -> None:
    """A video encoded as one (t, h, w) item equals its t frame units (1, h, w) encoded as
    items, rows in the same order: what the auto mode's planner relies on to spread a long
    video over the ranks (vision.dp_encoder.frame_units)."""
    tower = build_tower(arch, oracle[arch]["state"], TPGroup())
    grids = [(3, 8, 12), (1, 4, 6), (2, 6, 10)]
    whole = make_inputs(vision_config(arch), grids, seed=11)
    units = {"pixels": whole["pixels"], "grid": torch.tensor(frame_units(grids))}
    assert units["grid"].tolist() == [[1, 8, 12]] * 3 + [[1, 4, 6]] + [[1, 6, 10]] * 2
    as_items, as_units = run_cases(tower, [whole, units])
    # other GEMM shapes, so other summation orders: see assert_close
    assert_close(as_units, as_items, tower.cfg, whole["grid"])


# ---------------------------------------------------------------- pure helpers and errors


def test_window_index_matches_hand_layout() -> None:
    # A 6x10 patch frame is a 3x5 grid of merge units; windows are 2x2 units.
    order, cu = window_index(torch.tensor([[1, 6, 10]]), window_size=56, patch_size=14, merge=2)
    first_rows = [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert order.tolist() == first_rows
    assert (cu.diff() // 4).tolist() == [4, 4, 2, 2, 2, 1]


def test_position_table_taps_match_transformers() -> None:
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grid = torch.tensor([[1, 4, 6], [2, 10, 14], [1, 2, 2]])
    ours = position_table_taps(grid, side=6, merge=2)
    ref = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=6, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(ours[0], ref[0])
    # weights in [0, 1] from a handful of rounded steps (linspace, floor, differences, product)
    assert_within_rounding(ours[1], ref[1], terms=4, scale=1.0)


def test_position_ids_follow_merge_windows() -> None:
    pos = vision_position_ids(torch.tensor([[1, 2, 4]]), merge=2)
    assert pos.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_varlen_attention_stays_in_segments() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 7, 2, 8).unbind(0)
    cu = torch.tensor([0, 3, 5, 7])
    out = varlen_attention(q, k, v, cu, scale=0.3)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = varlen_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), scale=0.3)
        # other batch shapes may sum in other orders: q.k (8 terms), softmax and p.v (3 each)
        assert_within_rounding(out[a:b], ref, terms=8 + 2 * 3)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_head_count_must_divide_tp(arch: str) -> None:
    with pytest.raises(ValueError, match="not divisible by TP size 3"):
        TOWERS[arch](vision_config(arch), TPGroup(rank=0, size=3))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_unknown_checkpoint_name(arch: str) -> None:
    tower = TOWERS[arch](vision_config(arch), TPGroup())
    with pytest.raises(KeyError, match="blocks.9.attn.qkv.weight"):
        tower.load_weights([("blocks.9.attn.qkv.weight", torch.zeros(1))])


def test_config_shapes() -> None:
    cfg = vision_config("qwen2_vl")
    assert (cfg.embed_dim, cfg.intermediate_size, cfg.out_hidden_size) == (64, 128, 64)
    assert replace(cfg, num_heads=2).head_dim == 32


# ---------------------------------------------------------------- tensor parallel


def tp_worker(tp: TPGroup, data_path: str) -> dict[str, list[torch.Tensor]]:
    data = torch.load(data_path, weights_only=False)
    return {
        arch: run_cases(build_tower(arch, d["state"], tp), d["cases"]) for arch, d in data.items()
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_shards_match_one_rank(world_size: int, oracle: dict, tmp_path: Path) -> None:
    data = {arch: {"state": d["state"], "cases": d["cases"]} for arch, d in oracle.items()}
    data_path = tmp_path / "towers.pt"
    torch.save(data, data_path)
    expected = {
        arch: run_cases(build_tower(arch, d["state"], TPGroup()), d["cases"])
        for arch, d in data.items()
    }
    per_rank = run_on_ranks(tp_worker, world_size, str(data_path), timeout=120)
    worst = 0.0
    for outs in per_rank:
        for arch, refs in expected.items():
            for out, ref, case in zip(outs[arch], refs, data[arch]["cases"], strict=True):
                # a TP split sums each projection in parts: see assert_close
                worst = max(worst, assert_close(out, ref, vision_config(arch), case["grid"]))
    print(f"tp={world_size}: max abs diff vs one rank {worst:.2e}")
