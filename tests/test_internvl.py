"""InternVL 3, tessera's fourth family: config reading, the tiling rule against GotOcr2's,
checkpoint names of both published layouts, and the composite model against transformers'
`InternVLForConditionalGeneration` at tp 1 and 2, vision tower in TP, DP and auto mode, and at
tp 4 in TP mode on one image.

The oracle's inputs come from transformers' own InternVLProcessor (its chat template, the
GotOcr2 image processor's tiles, its placeholder expansion); tessera's prompt ids, built by its
own expansion, must equal them. DP mode balances tiles: one 13-tile image spreads over both ranks.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_utils import run_on_ranks
from numerics import assert_within_rounding, model_terms, vision_terms
from parity_worker import parity_worker
from PIL import Image
from safetensors.torch import load_file
from vlm_cases import (
    Case,
    assert_layouts_load_alike,
    gradient_image,
    noise_image,
    run_hf,
)

import runtime.tiny_checkpoint as mtc
from runtime.distributed import TPGroup
from runtime.families import internvl
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.multimodal import Modality, MultimodalDataItem
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.multimodal_inputs import (
    PreparedMedia,
    build_multimodal_inputs,
    expand_placeholder_ids,
    expand_placeholders,
)
from tokenizer_manager.media.settings import checked_settings, request_spec
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.video_processor import tile_patches
from tokenizer_manager.media.worker import process_image_bytes
from tokenizer_manager.protocol import APIError
from vision.vlm import build_model

MODES = ("tp", "dp", "auto")
NEW_TOKENS = 16
CASES = ("text", "image", "wide_image", "two_images")
# The presets checked against transformers here; hd64 (a peer benchmark's shape, 224-pixel tiles)
# is too slow for that on a CPU and is checked in test_tiny_checkpoint.py.
PARITY_PRESETS = ("tiny", "qk-norm", "heads5")


def wide_image() -> Image.Image:
    """56 x 392 (height x width): a 7 x 1 tile grid and a thumbnail."""
    return noise_image((56, 392), seed=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("internvl")
    return {p: mtc.make_checkpoint("internvl", root / p, preset=p) for p in PARITY_PRESETS}


@pytest.fixture(scope="module")
def folder(folders: dict[str, Path]) -> Path:
    return folders["tiny"]


def hf_processor(folder: Path) -> Any:
    """transformers' InternVLProcessor of the checkpoint. Its video processor needs torchvision,
    which this machine lacks; images never reach it, so it is built without one (the class check
    that insists on it is skipped for this one construction)."""
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = AutoImageProcessor.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *args: None
    try:
        return InternVLProcessor(
            image_processor=images, tokenizer=tokenizer, video_processor=None,
            image_seq_length=config["image_seq_length"], chat_template=tokenizer.chat_template,
        )  # fmt: skip
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def image_media(processor: Any, image: Image.Image, **settings: Any) -> PreparedMedia:
    """One image's tiles as the processor makes them (with these GotOcr2 settings), as
    tessera's patch rows."""
    settings = {"crop_to_patches": True, **settings}
    out = processor.image_processor(images=[image], return_tensors="np", **settings)
    rows, grid = tile_patches(out["pixel_values"], 14)
    return PreparedMedia(Modality.IMAGE, torch.from_numpy(rows), grid)


def make_case(
    processor: Any, config: ModelConfig, name: str, content: list[Any],
    system: str | None = None, **settings: Any,
) -> Case:
    """HF's inputs from its processor (with these image settings); tessera's from its own
    expansion (which must agree)."""
    parts = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
             for p in content]  # fmt: skip
    messages = [{"role": "user", "content": parts}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [p for p in content if isinstance(p, Image.Image)]
    hf = processor(images=images or None, text=[prompt], return_tensors="pt", **settings)
    media = [image_media(processor, image, **settings) for image in images]
    ids = expand_placeholder_ids(processor.tokenizer(prompt)["input_ids"], media, config)
    assert ids == hf["input_ids"][0].tolist(), name
    assert processor.tokenizer(expand_placeholders(prompt, media, config))["input_ids"] == ids
    inputs = {"input_ids": hf["input_ids"], "attention_mask": hf["attention_mask"]}
    if images:
        inputs["pixel_values"] = hf["pixel_values"]
    our_ids, mm = build_multimodal_inputs(ids, media, config)
    return Case(name, inputs, our_ids, mm)


family_case = make_case  # how tests/family_cases.py builds this family's oracle cases


def standard_cases(folder: Path) -> list[Case]:
    processor, config = hf_processor(folder), ModelConfig.from_dir(folder)
    return [
        make_case(processor, config, "text", ["Describe the cat."]),
        make_case(processor, config, "image", [noise_image(), "What is in the picture?"]),
        make_case(processor, config, "wide_image", [wide_image(), "What is in the picture?"]),
        make_case(processor, config, "two_images",
                  [gradient_image(), "and", noise_image(), "Compare them."]),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def oracle(folders: dict[str, Path]) -> dict[str, dict[str, Case]]:
    """Per preset: {case: HF's prefill logits and greedy tokens}."""
    from runtime.tiny_checkpoint import hf_model_class

    out = {}
    for preset, folder in folders.items():
        model = hf_model_class("internvl").from_pretrained(folder, dtype=torch.float32).eval()
        cases = standard_cases(folder)
        for case in cases:
            run_hf(model, case, NEW_TOKENS)
        out[preset] = {case.name: case for case in cases}
    return out


# ----------------------------------------------------------------------------- config


def test_config_reads_the_published_layout(folder: Path) -> None:
    config = ModelConfig.from_dir(folder)
    tokens = mtc.special_ids(mtc.family_tokenizer("internvl"))
    assert config.arch == "internvl" and config.family.positions.kind == "1d"
    assert config.text.mrope_section == (config.text.head_dim // 2,)
    assert config.image_token_id == tokens["<IMG_CONTEXT>"]
    # config.json names only the image token; the boundary tokens come from the tokenizer
    raw = json.loads((folder / "config.json").read_text())
    assert "start_image_token_id" not in raw and "end_image_token_id" not in raw
    assert config.vision_start_token_id == tokens["<img>"]
    assert config.vision_end_token_id == tokens["</img>"]
    v = config.vision
    assert (v.image_size, v.patch_size, v.spatial_merge_size, v.temporal_patch_size) == (56, 14,
                                                                                        2, 1)
    assert v.patch_dim == 3 * 14 * 14 and not v.qk_norm and v.norm_type == "layer_norm"
    with pytest.raises(ModelConfigError, match="the tokenizer lacks"):
        ModelConfig.from_dict(raw)  # without the tokenizer's ids


@pytest.mark.parametrize(
    ("where", "key", "value", "match"),
    [
        ("top", "image_seq_length", 5, "image_seq_length"),
        ("top", "vision_feature_layer", -2, "vision_feature_layer"),
        ("top", "projector_hidden_act", "relu", "projector_hidden_act"),
        ("vision", "norm_type", "batch_norm", "norm_type"),
        ("vision", "use_mean_pooling", False, "use_mean_pooling"),
        ("vision", "image_size", [56, 42], "square"),
    ],
)
def test_settings_tessera_does_not_compute_are_refused(
    folder: Path, where: str, key: str, value: Any, match: str
) -> None:
    raw = json.loads((folder / "config.json").read_text())
    (raw if where == "top" else raw["vision_config"])[key] = value
    tokens = mtc.special_ids(mtc.family_tokenizer("internvl"))
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(raw, tokens)


def test_tile_count_is_gotocr2s(folder: Path) -> None:
    """The header-side tile count equals the image processor's own, over many shapes."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (56, 392), (84, 112), (1000, 10), (10, 1000), (448, 448), (57, 113)]
    sizes += [tuple(int(x) for x in rng.integers(8, 2000, 2)) for _ in range(200)]
    for max_tiles in (1, 6, 12):
        kwargs = {"crop_to_patches": True, "max_patches": max_tiles}
        for h, w in sizes:
            expected = processor.get_number_of_image_patches(h, w, kwargs)
            assert internvl.tile_count(h, w, 56, 1, max_tiles) == expected, (h, w, max_tiles)


def test_tile_patches_are_the_patch_embeddings_rows(folder: Path) -> None:
    """Patch rows through the conv kernel as one GEMM equal transformers' Conv2d patch
    embedding, row for row (up to summation order)."""
    from transformers import AutoImageProcessor

    weights = load_file(str(folder / "model.safetensors"))
    prefix = "model.vision_tower.embeddings.patch_embeddings.projection."
    kernel, bias = weights[prefix + "weight"], weights[prefix + "bias"]
    processor = AutoImageProcessor.from_pretrained(folder)
    tiles = processor(images=[wide_image()], crop_to_patches=True, return_tensors="np")
    rows, grid = tile_patches(tiles["pixel_values"], 14)
    assert grid == (8, 4, 4)
    ours = torch.from_numpy(rows) @ kernel.reshape(kernel.shape[0], -1).T + bias
    conv = torch.nn.functional.conv2d(torch.from_numpy(tiles["pixel_values"]), kernel, bias, 14)
    theirs = conv.flatten(2).transpose(1, 2).reshape(-1, kernel.shape[0])
    assert_within_rounding(ours, theirs, rows.shape[1])


def test_checkpoint_names_of_both_published_layouts() -> None:
    name = internvl.checkpoint_name
    for new, old, ours in [
        ("model.language_model.layers.0.mlp.up_proj.weight",
         "language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("lm_head.weight", "language_model.lm_head.weight", "lm_head.weight"),
        ("model.vision_tower.encoder.layer.1.lambda_1", "vision_tower.encoder.layer.1.lambda_1",
         "visual.encoder.layer.1.lambda_1"),
        ("model.multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias",
         "visual.multi_modal_projector.linear_1.bias"),
    ]:  # fmt: skip
        assert name(new) == name(old) == ours


def old_layout_name(name: str) -> str:
    """transformers 4.x's LLaVA-style names of a 5.x tensor name."""
    for new, old in (("model.language_model.", "language_model.model."),
                     ("lm_head.", "language_model.lm_head."), ("model.vision_tower.",
                     "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(new):
            return old + name[len(new):]
    raise AssertionError(name)  # fmt: skip


def test_hf_loads_the_tiny_checkpoint_without_missing_keys(folders: dict[str, Path]) -> None:
    from runtime.tiny_checkpoint import hf_model_class

    for folder in folders.values():
        _, info = hf_model_class("internvl").from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], folder
        assert not info["mismatched_keys"] and not info["error_msgs"], folder


def test_both_layouts_load_the_same_model(folder: Path, tmp_path: Path) -> None:
    assert_layouts_load_alike(folder, tmp_path, old_layout_name)


# ----------------------------------------------------------------------------- model parity


def test_cases_cover_tiles_and_thumbnails(oracle: dict) -> None:
    cases = oracle["tiny"]
    grids = {name: [i.grid_thw for i in c.mm.items] for name, c in cases.items() if c.mm}
    assert grids == {"image": [(1, 4, 4)], "wide_image": [(8, 4, 4)],
                     "two_images": [(13, 4, 4), (1, 4, 4)]}  # fmt: skip
    image = cases["two_images"].mm.items[0]
    assert image.num_tokens == 13 * 4  # image_seq_length per tile
    assert cases["image"].hf_tokens != cases["wide_image"].hf_tokens  # the image matters


# every preset in every mode, but the 5-head tower in TP mode only: its padded heads are TP's
# (DP and auto mode run the one-rank tower, unpadded: tp 1 covers it; auto refuses it)
PRESET_MODES = [(p, m) for p in PARITY_PRESETS for m in MODES if p != "heads5" or m == "tp"]
# per TP size: the (preset, mode) pairs and cases run; tp 4 (the suite's time) in TP mode on one
# small image, the padded 5-head tower with it (2 heads a rank, 3 of them zero)
RUNS = {1: (PRESET_MODES, CASES), 2: (PRESET_MODES, CASES),
        4: ([("tiny", "tp"), ("heads5", "tp")], ("image",))}  # fmt: skip


@pytest.fixture(scope="module", params=list(RUNS), ids=lambda tp: f"tp{tp}")
def ranks(request: pytest.FixtureRequest, folders: dict, oracle: dict) -> tuple[int, list]:
    tp = request.param
    jobs = [
        (preset, str(folders[preset]), mode,
         [(c.name, c.input_ids, c.mm) for c in oracle[preset].values() if c.name in RUNS[tp][1]])
        for preset, mode in RUNS[tp][0]
    ]  # fmt: skip
    return tp, run_on_ranks(parity_worker, tp, jobs, NEW_TOKENS, timeout=500)


def assert_logits_match(folder: Path, logits: torch.Tensor, case: Case) -> float:
    """Rounding only (another summation order: GEMM patch embedding, TP splits, chunks)."""
    terms = model_terms(ModelConfig.from_dir(folder), len(case.input_ids))
    return assert_within_rounding(logits, case.hf_logits, terms)


def _keep(tp: int, params: dict) -> bool:
    pairs, cases = RUNS[tp]
    return (params["preset"], params["mode"]) in pairs and params["case"] in cases


def _params(fn):
    fn = pytest.mark.parametrize("case", CASES)(fn)
    ids = [f"{p}-vit_{m}" for p, m in PRESET_MODES]
    fn = pytest.mark.parametrize(("preset", "mode"), PRESET_MODES, ids=ids)(fn)
    return pytest.mark.parity_subset.with_args(_keep)(fn)


@_params
def test_prefill_logits_match_hf(ranks, folders, oracle, preset: str, mode: str, case: str) -> None:
    result = ranks[1][0][(preset, mode)]
    expected = oracle[preset][case]
    for key in ("logits", "chunked"):
        assert_logits_match(folders[preset], result[case][key], expected)
    assert_logits_match(folders[preset], result["_cut"][case], expected)


@_params
def test_greedy_tokens_match_hf_on_every_rank(
    ranks, oracle, preset: str, mode: str, case: str
) -> None:
    tp, results = ranks
    expected = oracle[preset][case].hf_tokens
    assert len(expected) == NEW_TOKENS
    for rank in range(tp):
        assert results[rank][(preset, mode)][case]["tokens"] == expected, f"rank {rank}"


def test_no_kv_slot_is_left_behind(ranks) -> None:
    for per_rank in ranks[1]:
        assert all(r["_kv_free"] and r["_cut"]["_kv_free"] for r in per_rank.values())


def padded_tower_worker(tp: TPGroup, folder: str) -> dict:
    """The 5-head tower's local head count in TP mode, and whether auto mode builds."""
    model = build_model(folder, tp, encoder_mode="tp", dtype="float32")
    attention = model.visual.layers[0].attention
    try:
        build_model(folder, tp, encoder_mode="auto", dtype="float32")
        auto = "built"
    except ValueError as exc:
        auto = str(exc)
    return {"heads": attention.qkv.num_heads, "auto": auto}


def test_a_head_count_tp_does_not_divide_is_padded(folders: dict[str, Path]) -> None:
    """5 heads at tp 2: 3 per rank (one zero head); the parity tests above hold it exact. Auto
    mode, whose TP plans shard the one-rank tower, is refused by name instead."""
    out = run_on_ranks(padded_tower_worker, 2, str(folders["heads5"]))
    assert [r["heads"] for r in out] == [3, 3]
    assert all("5 heads" in r["auto"] and "dp encoder mode" in r["auto"] for r in out)


# ----------------------------------------------------------------------------- DP balance


def dp_tiles_worker(tp: TPGroup, folder: str, item: MultimodalDataItem) -> dict:
    """Encode one item in DP mode; the tiles this rank's tower ran, and the rows."""
    model = build_model(folder, tp, encoder_mode="dp", dtype="float32")
    ran: list[int] = []
    model.visual.register_forward_pre_hook(lambda _m, args: ran.append(int(args[1][:, 0].sum())))
    rows = model.encode_items([item])[item.hash]
    return {"tiles": sum(ran), "rows": rows}


def test_dp_mode_spreads_one_images_tiles_over_the_ranks(folder: Path, oracle: dict) -> None:
    """A 13-tile image: 7 tiles on one rank, 6 on the other (not 13 and 0), and the same rows
    as one rank encoding it whole."""
    item = oracle["tiny"]["two_images"].mm.items[0]
    assert item.grid_thw[0] == 13
    one = run_on_ranks(dp_tiles_worker, 1, str(folder), item)[0]
    two = run_on_ranks(dp_tiles_worker, 2, str(folder), item)
    assert sorted(r["tiles"] for r in two) == [6, 7] and one["tiles"] == 13
    terms = vision_terms(ModelConfig.from_dir(folder).vision, 4**2 + 1)
    for result in two:  # the same sums, in GEMMs of other row counts
        assert_within_rounding(result["rows"], one["rows"], terms)


# ----------------------------------------------------------------------------- request settings


def request_tiles(folder: Path, raw: dict) -> tuple[ProcessorSpec, tuple[int, int, int]]:
    """A request's spec with these mm_processor_kwargs, and the grid its header is charged for
    the wide image."""
    spec = ProcessorSpec.from_checkpoint(str(folder), MediaLimits())
    spec = request_spec(spec, checked_settings(raw, spec))
    return spec, spec.image_grid(*wide_image().size[::-1])


@pytest.mark.parametrize("raw", [{"max_patches": 2}, {"min_patches": 3, "max_patches": 5},
                                 {"crop_to_patches": False}, {"min_patches": 9}])  # fmt: skip
def test_tile_settings_of_a_request_are_gotocr2s(folder: Path, raw: dict) -> None:
    """A request's GotOcr2 settings: the worker's tiles equal the processor's with them, and
    the header's charge counts them (the token budget's view)."""
    from transformers import AutoImageProcessor

    spec, grid = request_tiles(folder, raw)
    png = io.BytesIO()
    wide_image().save(png, format="PNG")
    ours = process_image_bytes(png.getvalue(), spec, MediaLimits())
    theirs = AutoImageProcessor.from_pretrained(folder)(
        images=[wide_image()], return_tensors="np", **{"crop_to_patches": True, **raw})
    rows, hf_grid = tile_patches(theirs["pixel_values"], 14)
    assert ours.grid_thw == hf_grid == grid != (8, 4, 4)
    assert np.array_equal(ours.to_prepared().pixel_values.numpy(), rows)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"max_patches": 13}, "max_patches"),  # more than the server's own 12
        ({"max_patches": 0}, "max_patches"),
        ({"min_patches": 5, "max_patches": 2}, "min_patches"),
        ({"crop_to_patches": "yes"}, "crop_to_patches"),
        ({"max_pixels": 100000}, "max_pixels"),
        ({"do_pan_and_scan": True}, "do_pan_and_scan"),  # Gemma 3's processor's
    ],
)
def test_bad_tile_settings_are_refused_by_name(folder: Path, raw: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        request_tiles(folder, raw)
    assert info.value.status == 400 and info.value.param == f"mm_processor_kwargs.{param}"
