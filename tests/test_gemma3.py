"""Gemma 3, tessera's sixth family: config reading (both layouts, and what it refuses), the
prompt expansion against transformers' Gemma3Processor, checkpoint names of both published
layouts, the attention rule of its images (bidirectional inside an image, OR-ed into the causal
and the sliding-window masks) against transformers' own masks, and the composite model against
transformers' `Gemma3ForConditionalGeneration` at tp 1 and 2, vision tower in TP, DP and auto
mode (tp 4: TP mode on one image): prefill logits whole, chunked (chunks moved off the inside of
images, as the scheduler moves them) and 16 greedy tokens. Pan-and-scan: the crop count of a
header against the processor's, a request's `do_pan_and_scan` through the media worker (pixels,
grid, digest), bad crop settings refused by name, and a parity case of an image with two crops
(three `<start_of_image>` runs of one item, each attending both ways within itself only).

The oracle's inputs come from transformers' own Gemma3Processor (its chat template rendering,
Gemma3ImageProcessorPil's pixels, its `\\n\\n<start_of_image>...<end_of_image>\\n\\n` expansion and
`token_type_ids`); tessera's prompt ids, from its own expansion, must equal them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import vlm_cases as vlm
from PIL import Image
from safetensors.torch import load_file
from vlm_cases import Case, assert_layouts_load_alike, gradient_image, noise_image, run_hf

import runtime.tiny_checkpoint as mtc
from kernels.attention.base import AttentionLayer
from kernels.attention.torch_backend import extend_mask
from runtime.families import gemma3
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.multimodal import Modality
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.multimodal_inputs import (
    PreparedMedia,
    expand_placeholder_ids,
    expand_placeholders,
)
from tokenizer_manager.media.settings import checked_settings, request_spec
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.video_processor import tile_patches
from tokenizer_manager.media.worker import process_image_bytes
from tokenizer_manager.protocol import APIError

MODES = ("tp", "dp", "auto")
NEW_TOKENS = 16
CASES = ("text", "image", "two_images", "pan_and_scan")
# A long image that pan-and-scan cuts into 2 crops (256 px a side at least, the processor's own
# minimum): 3 tiles, each its own <start_of_image> run
WIDE = noise_image((256, 600), seed=7)
LONG_TEXT = ("Describe the cat in the picture on the table next to the cup of tea, and tell me "
             "where each object is.")  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtc.make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "tiny")


def hf_processor(folder: Path) -> Any:
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    return Gemma3Processor(
        image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, image_seq_length=config["mm_tokens_per_image"],
    )  # fmt: skip


def image_media(processor: Any, image: Image.Image, pan_and_scan: bool = False) -> PreparedMedia:
    """The processor's pixels of one image (the whole image, then its pan-and-scan crops when
    asked for, with Gemma3Processor's own crop settings), as tessera's patch rows."""
    crops = gemma3.crop_kwargs(1, 1 + gemma3.MAX_CROPS) if pan_and_scan else {}
    out = processor.image_processor(images=[image], return_tensors="np",
                                    **{"do_pan_and_scan": False, **crops})  # fmt: skip
    rows, grid = tile_patches(out["pixel_values"], 14)
    assert grid[0] == 1 + int(out["num_crops"][0])
    return PreparedMedia(Modality.IMAGE, torch.from_numpy(rows), grid)


def make_case(
    processor: Any, config: ModelConfig, name: str, content: list[Any], pan_and_scan: bool = False
) -> Case:
    """HF's inputs from its processor (bidirectional images: `token_type_ids`; with
    `pan_and_scan`, its `do_pan_and_scan=True`); tessera's from its own text expansion (which
    must agree; no ids splice: see below)."""
    keys = ("pixel_values", "token_type_ids")
    settings = {"do_pan_and_scan": True} if pan_and_scan else None

    def media(proc: Any, image: Image.Image) -> PreparedMedia:
        return image_media(proc, image, pan_and_scan)

    return vlm.processor_case(processor, config, name, content, media, keys, False,
                              settings=settings)  # fmt: skip


def family_case(
    processor: Any, config: ModelConfig, name: str, content: list[Any],
    system: str | None = None, **settings: Any,
) -> Case:
    """tests/family_cases.py's case of this family: no system turn (the template joins it to
    the first user turn), and the processor's one setting, `do_pan_and_scan`."""
    assert system is None and set(settings) <= {"do_pan_and_scan"}
    return make_case(processor, config, name, content, settings.get("do_pan_and_scan", False))


def standard_cases(folder: Path) -> list[Case]:
    processor, config = hf_processor(folder), ModelConfig.from_dir(folder)
    return [
        make_case(processor, config, "text", [LONG_TEXT]),
        make_case(processor, config, "image", [noise_image((80, 60)), "What is in the picture?"]),
        make_case(processor, config, "two_images",
                  [gradient_image(), "and", noise_image(), "Compare them."]),
        make_case(processor, config, "pan_and_scan", [WIDE, "What is in the picture?"], True),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict[str, Case]:
    from runtime.tiny_checkpoint import hf_model_class

    model = hf_model_class("gemma3").from_pretrained(folder, dtype=torch.float32).eval()
    cases = standard_cases(folder)
    for case in cases:
        run_hf(model, case, NEW_TOKENS)
    return {case.name: case for case in cases}


# ----------------------------------------------------------------------------- config


def test_config_reads_the_published_layout(folder: Path) -> None:
    config = ModelConfig.from_dir(folder)
    ids = mtc.special_ids(mtc.family_tokenizer("gemma3"))
    assert config.arch == "gemma3" and config.family.positions.kind == "1d"
    assert config.family.image_attention == "bidirectional_item"
    t = config.text
    assert t.sliding_windows == (24, 24, 0) and t.qk_norm and t.post_norms
    assert (t.rope_theta, t.rope_local_theta, t.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert t.query_pre_attn_scalar == 16 and t.tie_word_embeddings and not t.attention_bias
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        ids["<image_soft_token>"], ids["<start_of_image>"], ids["<end_of_image>"])
    assert config.video_token_id == -1
    assert config.eos_token_ids == (ids["<eos>"], ids["<end_of_turn>"])
    v = config.vision
    assert (v.image_size, v.patch_size, v.spatial_merge_size, v.embed_dim) == (112, 14, 2, 64)


def test_transformers_5_layout_reads_the_same(folder: Path) -> None:
    """`layer_types` and per-type `rope_parameters` (as transformers 5.x writes them) give the
    same TextConfig as the published `sliding_window_pattern` / `rope_local_base_freq` /
    `rope_scaling` layout."""
    from transformers import AutoConfig

    written = json.loads(AutoConfig.from_pretrained(folder).to_json_string())
    assert "layer_types" in written["text_config"]
    assert "rope_local_base_freq" not in written["text_config"]
    tokens = mtc.special_ids(mtc.family_tokenizer("gemma3"))
    assert ModelConfig.from_dict(written, tokens).text == ModelConfig.from_dir(folder).text


def edit(raw: dict, where: str, key: str, value: Any) -> dict:
    raw = json.loads(json.dumps(raw))
    {"top": raw, "text": raw["text_config"], "vision": raw["vision_config"]}[where][key] = value
    return raw


@pytest.mark.parametrize(
    ("where", "key", "value", "match"),
    [
        ("text", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("text", "use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("text", "hidden_activation", "silu", "gelu_pytorch_tanh"),
        ("text", "rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "default or linear"),
        ("text", "layer_types", ["sliding_attention"], "layer_types"),
        ("text", "sliding_window", 8, "exceeds the sliding window"),
        ("top", "mm_tokens_per_image", 9, "cannot pool"),
        ("vision", "vision_use_head", True, "vision_use_head"),
    ],
)
def test_settings_it_cannot_compute_are_refused(folder: Path, where, key, value, match) -> None:  # noqa: ANN001
    """Each setting tessera does not compute is a ModelConfigError naming it."""
    edited = edit(json.loads((folder / "config.json").read_text()), where, key, value)
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(edited)


def test_tokenizer_holds_the_newline_runs_as_pieces(folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    for run in gemma3.NEWLINES:
        assert run in vocab and tokenizer(run)["input_ids"] == [vocab[run]]
    assert tokenizer.decode(tokenizer("a\n\n\nb")["input_ids"]) == "a\n\n\nb"


def test_prompt_ids_come_from_text_only() -> None:
    """The expansion puts "\\n\\n" around each image, which tokenizes with its neighbours: no
    splice of ids can say that, so the ids path declines (and text is tokenized)."""
    config = ModelConfig.from_dict(json.loads(json.dumps(gemma3.tiny_config(
        "tiny", mtc.special_ids(mtc.family_tokenizer("gemma3")), "float32"))))  # fmt: skip
    media = [PreparedMedia(Modality.IMAGE, torch.zeros(64, 588), (1, 8, 8))]
    ids = [1, config.vision_start_token_id, 2]
    assert expand_placeholder_ids(ids, media, config) is None
    with pytest.raises(ValueError, match="placeholder count"):  # a typed mark, no image
        expand_placeholder_ids(ids, [], config)
    text = expand_placeholders("a<start_of_image>b", media, config)
    assert text == "a\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\nb"


# ----------------------------------------------------------------------------- pan-and-scan

SIZES = [(256, 600), (600, 256), (256, 1100), (1200, 260), (300, 300), (256, 300), (250, 900),
         (80, 60), (256, 511), (256, 512), (257, 1800)]  # fmt: skip


def test_crop_count_is_the_processors(folder: Path) -> None:
    """The header's count of tiles (the whole image and its crops) equals the number of
    images Gemma3ImageProcessorPil makes with Gemma3Processor's own pan-and-scan settings."""
    processor = hf_processor(folder).image_processor
    kwargs = gemma3.crop_kwargs(1, 1 + gemma3.MAX_CROPS)
    for height, width in SIZES:
        image = noise_image((height, width))
        crops = processor(images=[image], return_tensors="np", **kwargs)["num_crops"][0]
        assert gemma3.crop_count(height, width, 112, 1, 1 + gemma3.MAX_CROPS) == 1 + crops
        assert gemma3.crop_count(height, width, 112, 1, 1) == 1


def request_crops(folder: Path, raw: dict) -> tuple[ProcessorSpec, tuple[int, int, int]]:
    """A request's spec with these mm_processor_kwargs, and the grid its header is charged for
    the wide image."""
    spec = ProcessorSpec.from_checkpoint(str(folder), MediaLimits())
    spec = request_spec(spec, checked_settings(raw, spec))
    return spec, spec.image_grid(*WIDE.size[::-1])


@pytest.mark.parametrize("on", [True, False])
def test_a_requests_pan_and_scan_is_the_processors(folder: Path, on: bool) -> None:
    """The worker's tiles with a request's do_pan_and_scan equal the processor's, its header
    is charged for them, and the item's digest (every cache's key) says the setting."""
    spec, grid = request_crops(folder, {"do_pan_and_scan": on})
    png = io.BytesIO()
    WIDE.save(png, format="PNG")
    ours = process_image_bytes(png.getvalue(), spec, MediaLimits())
    theirs = image_media(hf_processor(folder), WIDE, on)
    assert ours.grid_thw == theirs.grid_thw == grid == ((3, 8, 8) if on else (1, 8, 8))
    assert torch.equal(ours.to_prepared().pixel_values, theirs.pixel_values)
    plain = process_image_bytes(png.getvalue(), request_crops(folder, {})[0], MediaLimits())
    assert (ours.digest == plain.digest) == (not on)


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_a_requests_crop_cap_is_the_processors(folder: Path, cap: int) -> None:
    """pan_and_scan_max_num_crops with the switch on: the worker's crops, pixels and header
    charge equal Gemma3Processor's with that cap, and the cap is part of the digest."""
    raw = {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": cap}
    spec, grid = request_crops(folder, raw)
    image = noise_image((280, 1200), seed=3)  # 280 x 1200 px: four crops uncapped
    png = io.BytesIO()
    image.save(png, format="PNG")
    ours = process_image_bytes(png.getvalue(), spec, MediaLimits())
    kwargs = {**gemma3.crop_kwargs(1, 1 + gemma3.MAX_CROPS), "pan_and_scan_max_num_crops": cap}
    out = hf_processor(folder).image_processor(images=[image], return_tensors="np", **kwargs)
    rows, theirs = tile_patches(out["pixel_values"], 14)
    assert ours.grid_thw == tuple(theirs) == (1 + cap, 8, 8)
    assert spec.image_grid(280, 1200) == ours.grid_thw
    assert torch.equal(ours.to_prepared().pixel_values, torch.from_numpy(rows))
    uncapped = request_crops(folder, {"do_pan_and_scan": True})[0]
    other = process_image_bytes(png.getvalue(), uncapped, MediaLimits())
    assert (ours.digest == other.digest) == (cap == gemma3.MAX_CROPS)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"do_pan_and_scan": "yes"}, "do_pan_and_scan"),
        ({"do_pan_and_scan": 1}, "do_pan_and_scan"),
        ({"min_patches": 2}, "min_patches"),  # InternVL's processor's, not Gemma 3's
        ({"crop_to_patches": True}, "crop_to_patches"),
        ({"max_pixels": 100000}, "max_pixels"),
        ({"pan_and_scan_max_num_crops": 2}, "pan_and_scan_max_num_crops"),  # the switch off
        ({"do_pan_and_scan": False, "pan_and_scan_max_num_crops": 2}, "pan_and_scan_max_num_crops"),
        ({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0}, "pan_and_scan_max_num_crops"),
        ({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 5}, "pan_and_scan_max_num_crops"),
        ({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64}, "pan_and_scan_min_crop_size"),
    ],
)
def test_bad_crop_settings_are_refused_by_name(folder: Path, raw: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        request_crops(folder, raw)
    assert info.value.status == 400 and info.value.param == f"mm_processor_kwargs.{param}"
    assert param in info.value.message


# ----------------------------------------------------------------------------- weights


def test_checkpoint_names_of_both_published_layouts() -> None:
    name = gemma3.checkpoint_name
    for new, old, ours in [
        ("model.language_model.layers.0.pre_feedforward_layernorm.weight",
         "language_model.model.layers.0.pre_feedforward_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight"),
        ("model.language_model.layers.2.post_attention_layernorm.weight",
         "language_model.model.layers.2.post_attention_layernorm.weight",
         "model.layers.2.post_self_attn_layernorm.weight"),
        ("model.vision_tower.encoder.layers.1.layer_norm1.bias",
         "vision_tower.vision_model.encoder.layers.1.layer_norm1.bias",
         "visual.encoder.layers.1.layer_norm1.bias"),
        ("model.multi_modal_projector.mm_input_projection_weight",
         "multi_modal_projector.mm_input_projection_weight",
         "visual.multi_modal_projector.mm_input_projection_weight"),
    ]:  # fmt: skip
        assert name(new) == name(old) == ours


def new_layout_name(name: str) -> str:
    """transformers 5.x's names of a published (4.x, LLaVA-style) tensor name."""
    for old, new in (("language_model.model.", "model.language_model."),
                     ("vision_tower.vision_model.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(name)  # fmt: skip


def test_hf_loads_the_tiny_checkpoint_without_missing_keys(folder: Path) -> None:
    from runtime.tiny_checkpoint import hf_model_class

    _, info = hf_model_class("gemma3").from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "language_model.model.layers.0.post_feedforward_layernorm.weight" in names
    assert "vision_tower.vision_model.embeddings.position_embedding.weight" in names
    assert "language_model.lm_head.weight" not in names  # tied


def test_both_layouts_load_the_same_model(folder: Path, tmp_path: Path) -> None:
    assert_layouts_load_alike(folder, tmp_path, new_layout_name)


# ----------------------------------------------------------------------------- attention rule


@pytest.mark.parametrize("name", ["two_images", "pan_and_scan"])
@pytest.mark.parametrize("window", [None, 16, 24])
def test_image_attention_is_transformers_masks(
    oracle: dict[str, Case], window: int | None, name: str
) -> None:
    """The torch backend's mask for a prompt with two images (or one image and its two
    pan-and-scan crops: each run attends both ways within itself only, never to the next crop's)
    equals transformers' full and sliding masks built from its `token_type_ids`
    (create_masks_for_vision_model), whole and for a chunk that starts at the second run over a
    cached prefix. transformers applies the
    window to the image's own keys too; the two agree because an image is never longer than
    the window (16 soft tokens here; a longer one is refused with the config)."""
    from transformers.models.gemma3 import modeling_gemma3 as hf

    case = oracle[name]
    types, n = case.hf_inputs["token_type_ids"], case.hf_inputs["input_ids"].shape[1]
    config = _text_config(window)
    blocks = hf.get_block_sequence_ids_for_mask(types)
    masks = hf.create_masks_for_vision_model(
        config=config, inputs_embeds=torch.zeros(1, n, 8), attention_mask=None, cache=None,
        position_ids=torch.arange(n)[None], block_sequence_ids=blocks,
    )  # fmt: skip
    expected = masks["sliding_attention" if window else "full_attention"]
    expected = expected[0, 0] if expected.dtype == torch.bool else expected[0, 0] == 0
    spans = torch.zeros(n, 2, dtype=torch.int32)
    for item in case.mm.items:
        for lo, hi in item.offsets:
            spans[lo:hi] = torch.tensor([lo, hi])
    layer = AttentionLayer(0, 1, 1, 8, 1.0, sliding_window=window)
    assert torch.equal(extend_mask(n, n, layer, spans, torch.device("cpu")), expected)
    second = [lo for item in case.mm.items for lo, _ in item.offsets][1]
    tail = extend_mask(n - second, n, layer, spans[second:], torch.device("cpu"))
    assert torch.equal(tail, expected[second:])


def _text_config(window: int | None) -> Any:
    from transformers import Gemma3TextConfig

    kinds = ["sliding_attention" if window else "full_attention"]
    config = Gemma3TextConfig(num_hidden_layers=1, layer_types=kinds,
                              sliding_window=window or 4096)  # fmt: skip
    config._attn_implementation = "eager"  # a materialized mask, never an implicit one
    return config


# ----------------------------------------------------------------------------- model parity


def test_cases_cover_one_and_two_images(oracle: dict[str, Case]) -> None:
    grids = {name: [i.grid_thw for i in c.mm.items] for name, c in oracle.items() if c.mm}
    assert grids == {"image": [(1, 8, 8)], "two_images": [(1, 8, 8), (1, 8, 8)],
                     "pan_and_scan": [(3, 8, 8)]}  # fmt: skip
    crops = oracle["pan_and_scan"].mm.items[0].offsets
    assert len(crops) == 3 and all(hi - lo == gemma3.SOFT_TOKENS for lo, hi in crops)
    assert oracle["two_images"].mm.items[0].num_tokens == gemma3.SOFT_TOKENS
    assert len(oracle["text"].input_ids) > 24  # past the sliding window
    assert len(oracle["two_images"].input_ids) > 2 * 24
    assert oracle["image"].hf_tokens != oracle["text"].hf_tokens  # the image matters


ranks, test_prefill_logits_match_hf, test_greedy_tokens_match_hf_on_every_rank, \
    test_no_kv_slot_is_left_behind = vlm.parity_tests("gemma3", MODES, CASES, NEW_TOKENS,
                                                      tps=(1, 2, 4), subsets=vlm.TP4_SUBSET)
