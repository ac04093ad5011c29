"""Qwen3-VL pieces: the tiny checkpoint, flat and nested configs, interleaved MRoPE, frame
timestamps and timestamped video prompts, and a DP-mode tower that issues no collective.

Model numerics against HF at tp 1/2/4 live in test_model_parity.py (qwen3_vl is one of its
archs); the tower against HF in test_vision_towers.py; serving in test_server_qwen3_vl.py.
"""

from __future__ import annotations

import ast
import json
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from numerics import assert_within_rounding
from runner_utils import greedy_generate
from vlm_cases import Checkpoint, noise_image, video_frames

import runtime.tiny_checkpoint as mtc
from kernels.rotary import mrope_cos_sin
from runtime.distributed import TPGroup
from runtime.families.qwen2_vl import smart_resize
from runtime.model_config import ModelConfig
from runtime.multimodal import Modality
from scheduler.model_runner import ModelRunner
from scheduler.req import Req
from tokenizer_manager.media.multimodal_inputs import expand_placeholders
from tokenizer_manager.media.video_processor import (
    checkpoint_video_config,
    frame_timestamps,
    sample_frame_indices,
)
from vision.vlm import build_model


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtc.make_checkpoint("qwen3_vl", tmp_path_factory.mktemp("q3") / "qwen3_vl")


@pytest.fixture(scope="module")
def flat_folder(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint with a flat config.json (text fields at the top level)."""
    out = tmp_path_factory.mktemp("q3flat") / "qwen3_vl_flat"
    shutil.copytree(folder, out)
    nested = read_json(folder / "config.json")
    flat = {k: v for k, v in nested.items() if k != "text_config"} | nested["text_config"]
    flat["model_type"] = "qwen3_vl"
    (out / "config.json").write_text(json.dumps(flat))
    return out


# ----------------------------------------------------------------------------- checkpoint


def test_checkpoint_has_the_published_layout(folder: Path) -> None:
    from safetensors import safe_open

    config = read_json(folder / "config.json")
    text, vision = config["text_config"], config["vision_config"]
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert text["rope_scaling"] == {
        "mrope_interleaved": True,
        "mrope_section": [4, 4, 4],
        "rope_type": "default",
    }
    assert (text["head_dim"], text["attention_bias"], vision["patch_size"]) == (24, False, 16)
    assert vision["deepstack_visual_indexes"] == [0, 1]
    assert read_json(folder / "video_preprocessor_config.json")["patch_size"] == 16
    assert read_json(folder / "preprocessor_config.json")["image_mean"] == [0.5, 0.5, 0.5]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in names
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in names
    assert "model.visual.pos_embed.weight" in names and "lm_head.weight" in names


def test_hf_loads_every_tensor(folder: Path) -> None:
    _, info = mtc.hf_model_class("qwen3_vl").from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]


def test_streamed_state_matches_built_model(folder: Path) -> None:
    config = read_json(folder / "config.json")
    streamed = dict(mtc.streamed_state("qwen3_vl", config, 0, torch.float32))
    built = dict(mtc.published_state(mtc.build_model("qwen3_vl", config, 0), "qwen3_vl", False))
    assert streamed.keys() == built.keys()
    assert all(torch.equal(streamed[n], built[n]) for n in built)


def test_8b_preset_shapes() -> None:
    ids = mtc.special_ids(mtc.build_tokenizer())
    config = mtc.checkpoint_config("qwen3_vl", "7b", ids, "bfloat16")
    total = sum(p.numel() for p in mtc.meta_model("qwen3_vl", config).parameters())
    assert 8.7e9 < total < 8.8e9  # Qwen3-VL-8B
    parsed = ModelConfig.from_dict(config)
    assert parsed.text.mrope_section == (24, 20, 20) and parsed.vision.num_deepstack == 3


# ----------------------------------------------------------------------------- configs


def test_flat_and_nested_configs_parse_alike(folder: Path, flat_folder: Path) -> None:
    nested, flat = ModelConfig.from_dir(folder), ModelConfig.from_dir(flat_folder)
    assert nested.arch == flat.arch == "qwen3_vl"
    assert nested.text == flat.text and nested.vision == flat.vision
    assert nested.eos_token_ids == flat.eos_token_ids
    text = nested.text
    assert (text.head_dim, text.q_size, text.rope_theta) == (24, 96, 5e6)
    assert text.mrope_interleaved and text.qk_norm and not text.attention_bias
    vision = nested.vision
    assert (vision.patch_size, vision.num_position_embeddings, vision.patch_bias) == (16, 36, True)
    assert vision.embed_row_dim == 3 * vision.out_hidden_size


def test_flat_config_folder_serves_the_same_tokens(folder: Path, flat_folder: Path) -> None:
    ckpt = Checkpoint(folder)
    case = ckpt.case("image", [noise_image(), "What is in the picture?"])
    outputs = []
    for path in (folder, flat_folder):
        model = build_model(str(path), TPGroup(), dtype="float32")
        runner = ModelRunner(
            model, max_total_tokens=256, max_running_requests=1, max_context_len=128
        )
        outputs.append(greedy_generate(runner, Req(list(case.input_ids), case.mm), 8))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


# ----------------------------------------------------------------------------- positions


def test_interleaved_mrope_matches_transformers() -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
            "mrope_interleaved": True}
    config = Qwen3VLTextConfig(head_dim=128, rope_parameters=rope)
    positions = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(0))
    cos_ref, sin_ref = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    cos, sin = mrope_cos_sin(positions, 128, 5e6, (24, 20, 20), interleaved=True)
    # The angles (at most 255 rad: frequencies <= 1) round a little differently (float64 here):
    # the frequency's power, the product, then cos/sin, 3 eps of the largest angle; a wrong axis
    # would be off by order one.
    angle = float(positions.max())
    assert_within_rounding(cos, cos_ref[0], terms=3, scale=angle)
    assert_within_rounding(sin, sin_ref[0], terms=3, scale=angle)


def test_frame_timestamps_match_transformers() -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in (([0, 3, 6, 9], 4.0), ([0, 12, 24, 36, 48], 24.0), ([5], 2.0)):
        ref = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert list(frame_timestamps(indices, fps)) == pytest.approx(ref, abs=0)


def hf_video_functions() -> SimpleNamespace:
    """`smart_resize` and `sample_frames` of transformers' Qwen3-VL video processor, compiled from
    its source file (the module itself needs torchvision to import, which this machine lacks)."""
    import logging
    import math

    import numpy as np
    import transformers

    path = Path(transformers.__file__).parent / "models/qwen3_vl/video_processing_qwen3_vl.py"
    tree = ast.parse(path.read_text())
    wanted = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
              and n.name in ("smart_resize", "sample_frames")]
    scope: dict[str, Any] = {"math": math, "np": np, "logger": logging.getLogger("hf")}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), scope)  # noqa: S102
    return SimpleNamespace(smart_resize=scope["smart_resize"], sample_frames=scope["sample_frames"])


def test_video_resize_and_sampling_follow_transformers(folder: Path) -> None:
    """Qwen3-VL's video rules: pixel bounds per clip, frame counts not rounded to patches."""
    from transformers.video_utils import VideoMetadata

    hf = hf_video_functions()
    cfg = checkpoint_video_config(folder)
    assert cfg.clip_budget and (cfg.patch_size, cfg.image_mean) == (16, (0.5, 0.5, 0.5))
    for frames, height, width in ((4, 64, 96), (5, 480, 640), (2, 30, 1000), (8, 1080, 1920)):
        bounds = dict(factor=32, min_pixels=4096, max_pixels=200704)
        ref = hf.smart_resize(frames, height, width, temporal_factor=2, **bounds)
        ours = smart_resize(height, width, **bounds, num_frames=frames, temporal_factor=2)
        assert ours == ref, (frames, height, width)
    fake = SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    for total, fps in ((9, 4.0), (100, 30.0), (3, 24.0), (61, 24.0)):
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        ref = hf.sample_frames(fake, meta).tolist()
        assert sample_frame_indices(total, fps, 2, 4, 768, 2, clip_budget=True) == ref


def test_video_is_one_item_with_a_stamped_run_per_temporal_patch(folder: Path) -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    ckpt = Checkpoint(folder)
    media = ckpt.video_media(video_frames(4, (64, 96)))
    prompt, _ = ckpt.prepare([media, "What happens?"])
    text = expand_placeholders(prompt, [media], ckpt.config)
    frame = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    assert f"user\n<0.2 seconds>{frame}<1.2 seconds>{frame}What happens?" in text
    case = ckpt.case("video", [media, "What happens?"])
    (item,) = case.mm.items
    assert item.modality == Modality.VIDEO and len(item.offsets) == 2
    assert all(e - s == 6 for s, e in item.offsets)
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=partial(Qwen3VLModel.get_vision_position_ids, None),
    )
    hf = case.hf_inputs
    ref, delta = Qwen3VLModel.get_rope_index(
        fake, hf["input_ids"], hf["mm_token_type_ids"], video_grid_thw=hf["video_grid_thw"]
    )
    assert torch.equal(case.mm.mrope_positions, ref[:, 0])
    assert case.mm.mrope_position_delta == int(delta)


# ----------------------------------------------------------------------------- DP tower


def test_dp_mode_tower_issues_no_collective(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tower built for DP mode (one-rank group) never calls torch.distributed."""
    import torch.distributed as dist

    def forbidden(*_: Any, **__: Any) -> None:
        raise AssertionError("collective inside the DP-mode tower")

    model = build_model(str(folder), TPGroup(), dtype="float32")
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, forbidden)
    grid = torch.tensor([[1, 4, 6], [2, 6, 4]])
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid.prod(dim=1).sum()), model.config.vision.patch_dim, generator=gen)
    with torch.inference_mode():
        out = model.visual(pixels, grid)
    assert out.shape == (6 + 12, model.config.vision.embed_row_dim)
