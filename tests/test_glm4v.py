"""GLM-4.1V, tessera's fifth family: config reading (and what it refuses), the resize rule
against Glm4vImageProcessor's, the partial pairwise MRoPE and the interpolated position table
against transformers' own functions, checkpoint names of both published layouts, videos (frame
sampling, clip resize, patch layout, the timestamped prompt and its positions against
Glm4vVideoProcessor's and Glm4vProcessor's own functions), and the composite model against
transformers' `Glm4vForConditionalGeneration` at tp 1 and 2, vision tower in TP, DP and auto
mode, and at tp 4 in TP mode on one image.

The oracle's inputs are the checkpoint's tokenizer, chat template and Glm4vImageProcessorPil
(no torchvision here: video frames are resized by tessera's code, every other video rule is
checked against transformers'), with `mm_token_type_ids` as Glm4vProcessor makes them.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import vlm_cases as vlm
from safetensors.torch import load_file
from vlm_cases import Case, Checkpoint, load_hf, run_hf

import runtime.tiny_checkpoint as mtc
from kernels.rotary import apply_rotary, mrope_cos_sin, rotary_permutation
from runtime.distributed import TPGroup
from runtime.families import glm4v
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.multimodal import Modality
from tokenizer_manager.media.multimodal_inputs import PreparedMedia, expand_placeholders
from tokenizer_manager.media.video_processor import (
    VideoProcessingConfig,
    checkpoint_video_config,
    frames_to_patches,
    interval_frame_indices,
    normalize_frames,
    sample_frame_indices,
)
from vision.vlm import build_model

MODES = ("tp", "dp", "auto")
NEW_TOKENS = 16
CASES = ("text", "image", "large_image", "two_images", "video")
VIDEO = vlm.video_frames(4, (56, 84))  # two temporal patches of 4 x 6 patches


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtc.make_checkpoint("glm4v", tmp_path_factory.mktemp("glm4v") / "tiny")


def standard_cases(folder: Path) -> list[Case]:
    ckpt = Checkpoint(folder)
    return [
        ckpt.case("text", ["Describe the cat."]),
        ckpt.case("image", [vlm.noise_image(), "What is in the picture?"]),
        # 168 x 252 px: a 12 x 18 patch grid, larger than the 8 x 8 position table
        ckpt.case("large_image", [vlm.noise_image((168, 252), seed=2), "What is in the picture?"]),
        ckpt.case("two_images", [vlm.gradient_image(), "and", vlm.noise_image(), "Compare them."]),
        ckpt.case("video", [VIDEO, "What happens?"]),
    ]


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict[str, Case]:
    """{case: HF's prefill logits and greedy tokens}."""
    model = load_hf(folder)
    cases = standard_cases(folder)
    for case in cases:
        run_hf(model, case, NEW_TOKENS)
    return {case.name: case for case in cases}


def tokens() -> dict[str, int]:
    return mtc.special_ids(mtc.family_tokenizer("glm4v"))


# ----------------------------------------------------------------------------- config


def test_config_reads_the_published_layout(folder: Path) -> None:
    config = ModelConfig.from_dir(folder)
    ids = tokens()
    assert config.arch == "glm4v" and config.family.positions.kind == "mrope"
    t = config.text
    assert (t.head_dim, t.rotary_dim, t.mrope_section) == (16, 8, (2, 1, 1))
    assert t.rotary_pairs and t.post_norms and t.attention_bias
    assert config.image_token_id == ids["<|image|>"]
    assert config.vision_start_token_id == ids["<|begin_of_image|>"]
    assert config.vision_end_token_id == ids["<|end_of_image|>"]
    v = config.vision
    assert (v.image_size, v.patch_size, v.norm_eps, v.attention_bias) == (112, 14, 1e-5, False)
    assert (v.intermediate_size, v.out_hidden_size) == (96, 64)


def edit(raw: dict, where: str, key: str, value: Any) -> dict:
    raw = json.loads(json.dumps(raw))
    target = {"top": raw, "text": raw["text_config"], "vision": raw["vision_config"],
              "rope": raw["text_config"]["rope_parameters"]}[where]  # fmt: skip
    target[key] = value
    return raw


@pytest.mark.parametrize(
    ("where", "key", "value", "match"),
    [
        ("rope", "partial_rotary_factor", 1.0, "does not cover the rotary dim"),
        ("rope", "rope_type", "yarn", "default one"),
        ("text", "head_dim", 32, "head_dim must be hidden / heads"),
        ("text", "hidden_act", "gelu", "silu"),
        ("vision", "out_hidden_size", 32, "out_hidden_size"),
        ("vision", "image_size", 100, "multiple of"),
    ],
)
def test_settings_tessera_does_not_compute_are_refused(
    folder: Path, where: str, key: str, value: Any, match: str
) -> None:
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(edit(raw, where, key, value))


def test_resize_is_glm4vs(folder: Path) -> None:
    """The header-side target size and token count equal Glm4vImageProcessor's."""
    from transformers import AutoImageProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    processor = AutoImageProcessor.from_pretrained(folder)
    assert type(processor).__name__ == "Glm4vImageProcessorPil"
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (10, 300), (27, 27), (168, 252), (1000, 10), (3000, 2000)]
    sizes += [tuple(int(x) for x in rng.integers(8, 3000, 2)) for _ in range(300)]
    for lo, hi in ((3136, 200704), (112 * 112, 28 * 28 * 15000)):
        kwargs = {"size": {"shortest_edge": lo, "longest_edge": hi}}
        for h, w in sizes:
            ours = glm4v.resize(h, w, 28, lo, hi)
            assert ours == smart_resize(2, h, w, 2, 28, lo, hi), (h, w)
            patches = processor.get_number_of_image_patches(h, w, kwargs)
            assert (ours[0] // 14) * (ours[1] // 14) == patches, (h, w)


def test_partial_pairwise_mrope_matches_transformers(folder: Path) -> None:
    """Permuted q, k through tessera's neox rotary, permuted back, equal transformers' partial
    rotary of adjacent pairs, and q . k is the same either way."""
    from transformers import AutoConfig
    from transformers.models.glm4v import modeling_glm4v as hf

    text = AutoConfig.from_pretrained(folder).text_config
    rope = hf.Glm4vTextRotaryEmbedding(text)
    positions = torch.stack([torch.arange(12), torch.arange(12) % 4, torch.arange(12) // 3])
    q = torch.randn(12, 4, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = rope(q, positions[:, None, :])
    expected, _ = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None],
                                          cos, sin)  # fmt: skip
    expected = expected[0].transpose(0, 1)
    perm = rotary_permutation(16, 8, pairs=True)
    ours_cos, ours_sin = mrope_cos_sin(positions, 16, 10000.0, (2, 1, 1), rotary_dim=8)
    rotated = apply_rotary(q[..., perm], ours_cos, ours_sin)
    back = torch.empty_like(rotated)
    back[..., perm] = rotated
    torch.testing.assert_close(back, expected, rtol=0, atol=1e-6)
    assert torch.equal(rotary_permutation(16, 16, pairs=False), torch.arange(16))


def test_position_table_interpolation_is_transformers(folder: Path) -> None:
    """The learned table sampled for grids smaller, equal and larger than it, and one of
    another aspect: the same floats as transformers' Glm4vVisionEmbeddings."""
    from transformers import AutoConfig
    from transformers.models.glm4v import modeling_glm4v as hf

    model = build_model(str(folder), TPGroup(), dtype="float32", cpu_linear="aten")
    grid = torch.tensor([[1, 4, 4], [1, 8, 8], [1, 12, 18], [1, 20, 6]])
    embeddings = hf.Glm4vVisionEmbeddings(AutoConfig.from_pretrained(folder).vision_config)
    table = model.visual.embeddings["position_embedding"].weight
    embeddings.position_embedding.weight.data.copy_(table)
    rowcol = torch.cat([torch.cartesian_prod(torch.arange(h), torch.arange(w))
                        .reshape(h // 2, 2, w // 2, 2, 2).transpose(1, 2).reshape(-1, 2)
                        for _, h, w in grid.tolist()])  # fmt: skip
    zeros = torch.zeros(rowcol.shape[0], table.shape[1])
    lengths = grid.prod(dim=1)
    expected = embeddings(zeros, lengths, grid, rowcol[:, 0], rowcol[:, 1])
    assert torch.equal(model.visual.positions(grid), expected)


def token_types(input_ids: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF's `mm_token_type_ids` of this family (tests/vlm_cases.py asks): its processor's
    create_mm_token_type_ids on `input_ids` [1, n] (it reads three ids)."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    fake = SimpleNamespace(
        video_start_id=config.video_start_token_id,
        video_end_id=config.video_end_token_id,
        image_token_id=config.image_token_id,
    )
    return torch.tensor(Glm4vProcessor.create_mm_token_type_ids(fake, input_ids.tolist()))


# ----------------------------------------------------------------------------- video


def test_video_settings_are_the_checkpoints(folder: Path) -> None:
    cfg = checkpoint_video_config(folder)
    assert (cfg.sampling, cfg.clip_budget, cfg.fps, cfg.max_duration) == ("interval", True, 2, 300)
    assert (cfg.min_pixels, cfg.max_pixels) == (12544, 47040000)


def test_frame_sampling_is_glm4v_video_processors(folder: Path) -> None:
    """The frame indices (with the checkpoint's settings) equal Glm4vVideoProcessor's
    sample_frames' (which runs without torchvision) for short, long, sparse and single-frame
    videos; the server's frame bound spreads fewer frames over the whole video instead."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf = Glm4vVideoProcessor()
    settings = dataclasses.replace(checkpoint_video_config(folder), max_frames=10**6)
    cases = ((8, 4.0), (9, 4.0), (100, 30.0), (3, 24.0), (61, 24.0), (1, 2.0), (5, 1.0),
             (7, 25.0), (20000, 30.0), (9001, 30.0))  # fmt: skip
    for total, fps in cases:
        meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        ours = sample_frame_indices(total, fps, **settings.sampling_kwargs())
        assert ours == hf.sample_frames(meta).tolist(), (total, fps)
    bounded = interval_frame_indices(3000, 30.0, 2.0, 64)
    assert len(bounded) == 64 and bounded[0] == 0 and bounded[-1] == 2999


def test_clip_resize_and_patches_are_glm4v_video_processors() -> None:
    """Target size: the video processor's smart_resize over the whole clip; patch rows: its
    patchify (torch only) of the same normalised frames."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.models.glm4v.video_processing_glm4v import smart_resize as hf_resize

    rng = np.random.default_rng(0)
    sizes = [(56, 84), (10, 300), (27, 27), (480, 640), (1080, 1920), (3000, 20)]
    sizes += [tuple(int(x) for x in rng.integers(8, 3000, 2)) for _ in range(100)]
    for frames in (2, 4, 7, 64):
        for lo, hi in ((12544, 47040000), (12544, 200704)):
            for h, w in sizes:
                ours = glm4v.resize(h, w, 28, lo, hi, frames, 2)
                assert ours == hf_resize(frames, h, w, 2, 28, lo, hi), (frames, h, w)
    cfg = VideoProcessingConfig(clip_budget=True)
    ours, grid = frames_to_patches(VIDEO, cfg)
    normed = normalize_frames(VIDEO, cfg.rescale_factor, cfg.image_mean, cfg.image_std)
    videos = torch.from_numpy(normed).permute(0, 3, 1, 2)[None]
    ref, *hf_grid = Glm4vVideoProcessor().patchify(videos, 14, 2, 2)
    assert grid == tuple(hf_grid) == (2, 4, 6)
    assert torch.equal(torch.from_numpy(ours), ref[0])


def hf_video_text(media: PreparedMedia, indices: list[int], fps: float) -> str:
    """Glm4vProcessor.replace_video_token's text for the video (it reads the merge size, the
    image token and the sampled frames' metadata)."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.video_utils import VideoMetadata

    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), image_token="<|image|>")
    fake.replace_frame_token_id = partial(Glm4vProcessor.replace_frame_token_id, fake)
    meta = VideoMetadata(total_num_frames=len(indices), fps=fps, frames_indices=indices)
    inputs = {"video_grid_thw": torch.tensor([media.grid_thw]), "video_metadata": [meta]}
    return Glm4vProcessor.replace_video_token(fake, inputs, 0)


def test_video_prompt_and_positions_are_transformers(folder: Path) -> None:
    """One video between images: the prompt text equals Glm4vProcessor's (each temporal patch
    an image run and its first frame's whole seconds, inside the template's video boundaries),
    the video is one item with a run per temporal patch, and the MRoPE positions and decode
    delta equal Glm4vModel.get_rope_index on Glm4vProcessor's token types."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel

    ckpt = Checkpoint(folder)
    video = ckpt.video_media(vlm.video_frames(6, (56, 84)))
    content = [vlm.noise_image(), video, "What happens?", vlm.gradient_image()]
    prompt, media = ckpt.prepare(content)
    frames = hf_video_text(video, list(range(6)), vlm.VIDEO_FPS)
    assert frames.endswith("<|end_of_image|>2") and frames.count("<|begin_of_image|>") == 3
    first, second = (m for m in media if m.modality == Modality.IMAGE)
    images = iter("<|image|>" * (int(np.prod(m.grid_thw)) // 4) for m in (first, second))
    pieces = prompt.replace("<|video|>", "\0").split("<|image|>")  # as HF: one pad per item
    expected = "".join(p + next(images, "") for p in pieces).replace("\0", frames)
    assert "<|begin_of_video|>" + frames + "<|end_of_video|>" in expected
    assert expand_placeholders(prompt, media, ckpt.config) == expected
    case = ckpt.case("mixed", content)
    items = case.mm.items
    assert [i.modality for i in items] == [Modality.IMAGE, Modality.VIDEO, Modality.IMAGE]
    assert len(items[1].offsets) == 3 and all(e - s == 6 for s, e in items[1].offsets)
    hf = case.hf_inputs
    assert int((hf["mm_token_type_ids"] == 2).sum()) == 18
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=partial(Glm4vModel.get_vision_position_ids, None),
    )
    ref, delta = Glm4vModel.get_rope_index(
        fake, hf["input_ids"], hf["mm_token_type_ids"], hf["image_grid_thw"],
        hf["video_grid_thw"],
    )  # fmt: skip
    assert torch.equal(case.mm.mrope_positions, ref[:, 0])
    assert case.mm.mrope_position_delta == int(delta)


# ----------------------------------------------------------------------------- weights


def old_layout_name(name: str) -> str:
    """The older published names: the decoder at `model.*`, the tower at `visual.*`."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new) :]
    assert name == "lm_head.weight", name
    return name


def test_hf_loads_the_tiny_checkpoint_without_missing_keys(folder: Path) -> None:
    _, info = mtc.hf_model_class("glm4v").from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "model.language_model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.language_model.layers.0.post_mlp_layernorm.weight" in names
    assert "model.visual.embeddings.position_embedding.weight" in names


def test_both_layouts_load_the_same_model(folder: Path, tmp_path: Path) -> None:
    vlm.assert_layouts_load_alike(folder, tmp_path, old_layout_name)


# ----------------------------------------------------------------------------- model parity


def test_cases_cover_small_and_large_grids(oracle: dict[str, Case]) -> None:
    grids = {name: [i.grid_thw for i in c.mm.items] for name, c in oracle.items() if c.mm}
    assert grids == {"image": [(1, 4, 4)], "large_image": [(1, 12, 18)],
                     "two_images": [(1, 6, 8), (1, 4, 4)], "video": [(2, 4, 6)]}  # fmt: skip
    assert oracle["video"].hf_tokens != oracle["image"].hf_tokens
    assert oracle["image"].hf_tokens != oracle["large_image"].hf_tokens  # the image matters
    assert len(oracle["image"].hf_inputs["mm_token_type_ids"][0].nonzero()) == 4


ranks, test_prefill_logits_match_hf, test_greedy_tokens_match_hf_on_every_rank, \
    test_no_kv_slot_is_left_behind = vlm.parity_tests(
        "glm4v", MODES, CASES, NEW_TOKENS, tps=(1, 2, 4), subsets=vlm.TP4_SUBSET
    )
