"""GLM-4.1V, tessera's fifth family: config reading (and what it refuses), the resize rule
against Glm4vImageProcessor's, the partial pairwise MRoPE and the interpolated position table
against transformers' own functions, checkpoint names of both published layouts, and the
composite model against transformers' `Glm4vForConditionalGeneration` at tp 1 and 2, vision
tower in TP, DP and auto mode.

The oracle's inputs are the checkpoint's tokenizer, chat template and Glm4vImageProcessorPil
(no torchvision here), with `mm_token_type_ids` as transformers' generate needs them.
"""

from __future__ import annotations

import json
from pathlib import Path
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
from vision.vlm import build_model

MODES = ("tp", "dp", "auto")
NEW_TOKENS = 16
CASES = ("text", "image", "large_image", "two_images")


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
                     "two_images": [(1, 6, 8), (1, 4, 4)]}  # fmt: skip
    assert oracle["image"].hf_tokens != oracle["large_image"].hf_tokens  # the image matters
    assert len(oracle["image"].hf_inputs["mm_token_type_ids"][0].nonzero()) == 4


ranks, test_prefill_logits_match_hf, test_greedy_tokens_match_hf_on_every_rank, \
    test_no_kv_slot_is_left_behind = vlm.parity_tests("glm4v", MODES, CASES, NEW_TOKENS)
