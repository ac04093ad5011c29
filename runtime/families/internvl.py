"""InternVL 3 (transformers' `InternVLForConditionalGeneration`, the published `-hf` checkpoints):
an InternViT tower over fixed-size image tiles (class token, learned position table, layer
scales, LayerNorm or RMSNorm, optional RMSNorm over q and k), a pixel shuffle that folds each
2 x 2 (1 / downsample_ratio) patch window into one token, an MLP projector, and a Qwen2 decoder
with plain 1-D RoPE.

An image is cut into up to `max_patches` tiles whose grid best matches its aspect ratio, plus a
thumbnail of the whole image (`tile_count`); its grid is (tiles, side / patch, side / patch) and
it takes `image_seq_length` tokens per tile. The chat template writes `<IMG_CONTEXT>` once per
image; the processor expands it to `<img>` + the tile tokens + `</img>`. config.json names only
the image token's id; the boundary tokens' ids come from the tokenizer.
"""

from __future__ import annotations

from typing import Any

from runtime.families import qwen2_vl
from runtime.families.base import (
    Family,
    Fields,
    MediaTokens,
    ModelConfigError,
    PositionKind,
    Tiling,
)
from runtime.families.tiny import TinyCheckpoint
from runtime.multimodal import Modality, item_tokens

ARCHITECTURE = "InternVLForConditionalGeneration"
TOKENS = MediaTokens(
    image_pad="<IMG_CONTEXT>",
    video_pad="<video>",
    start="<img>",
    end="</img>",
    start_id_key="start_image_token_id",
    end_id_key="end_image_token_id",
    template_wraps=False,
)
NORM_TYPES = ("layer_norm", "rms_norm")


def text_fields(text: dict, top: dict) -> Fields:
    """The Qwen2 decoder with plain RoPE: one rotary section over the whole head (the three
    position rows are equal, `PositionKind("1d")`)."""
    fields = qwen2_vl.decoder_fields(text, top)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelConfigError(f"InternVL's decoder rotary must be plain RoPE, got {rope}")
    theta = float(rope.get("rope_theta", text.get("rope_theta", 1000000.0)))
    section = (fields["head_dim"] // 2,)
    return {**fields, "rope_theta": theta, "mrope_section": section}


def square(value: Any, name: str) -> int:
    """One side of a square size given as an int or [height, width]."""
    sides = value if isinstance(value, (list, tuple)) else (value, value)
    if len(sides) != 2 or sides[0] != sides[1]:
        raise ModelConfigError(f"InternVL's vision {name} must be square, got {value}")
    return int(sides[0])


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    top = top or {}
    check_supported(v, top)
    patch, side = square(v.get("patch_size", 14), "patch_size"), square(v["image_size"], "size")
    merge = round(1 / float(top.get("downsample_ratio", 0.5)))
    per_tile = (side // patch) ** 2 // merge**2
    if side % (patch * merge) or int(top.get("image_seq_length", per_tile)) != per_tile:
        raise ModelConfigError(f"image_seq_length {top.get('image_seq_length')} does not match "
                               f"tiles of {side} px, {patch} px patches, downsample 1/{merge}")
    if v.get("norm_type", "layer_norm") not in NORM_TYPES:
        raise ModelConfigError(f"vision norm_type {v['norm_type']!r} is not one of {NORM_TYPES}")
    return dict(
        **tile_tower_fields(v, text_hidden, patch, side, merge),
        norm_type=str(v.get("norm_type", "layer_norm")),
        qk_norm=bool(v.get("use_qk_norm", False)),
        attention_bias=bool(v.get("attention_bias", False)),
    )


def tile_tower_fields(v: dict, text_hidden: int, patch: int, side: int, merge: int) -> Fields:
    """The vision fields of a tower over fixed-size square tiles of `side` pixels (InternViT,
    SigLIP), read from its HF vision config `v`; `merge`: the window folded into one token."""
    return dict(
        depth=int(v["num_hidden_layers"]),
        embed_dim=int(v["hidden_size"]),
        num_heads=int(v["num_attention_heads"]),
        intermediate_size=int(v["intermediate_size"]),
        out_hidden_size=text_hidden,
        patch_size=patch,
        temporal_patch_size=1,
        spatial_merge_size=merge,
        in_channels=int(v.get("num_channels", 3)),
        hidden_act=str(v.get("hidden_act", "gelu")),
        image_size=side,
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )


# What the published checkpoints use; another value changes the computation and is refused.
FIXED = {
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
}
FIXED_VISION = {"use_mean_pooling": True, "use_absolute_position_embeddings": True}


def check_supported(v: dict, top: dict) -> None:
    for where, fixed in ((top, FIXED), (v, FIXED_VISION)):
        for key, value in fixed.items():
            if where.get(key, value) != value:
                raise ModelConfigError(f"InternVL {key}={where[key]!r} is not supported "
                                       f"(only {value!r})")


# Checkpoint tensor prefixes of the published layouts (transformers 5.x `model.*`, the older
# `language_model.*` one) -> the composite's names: the tower and projector under `visual.`.
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "visual."),
    ("vision_tower.", "visual."),
    ("model.multi_modal_projector.", "visual.multi_modal_projector."),
    ("multi_modal_projector.", "visual.multi_modal_projector."),
)


def renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first of `prefixes` (old, new) it starts with replaced; else Qwen2-VL's
    layouts' rule."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return qwen2_vl.checkpoint_name(name)


def checkpoint_name(name: str) -> str:
    return renamed(name, PREFIXES)


def tile_grid(
    height: int, width: int, side: int, min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """(columns, rows) of tiles whose aspect ratio is closest to the image's, among the grids
    of min_tiles..max_tiles tiles (fewest tiles first); on a tie the grid with more tiles wins
    while the image's area exceeds half of it. Pure."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]  # fmt: skip
    grids.sort(key=lambda g: g[0] * g[1])  # stable: columns-major order within a count
    aspect, area = width / height, width * height
    best, best_gap = (1, 1), float("inf")
    for columns, rows in grids:
        gap = abs(aspect - columns / rows)
        if gap < best_gap:
            best, best_gap = (columns, rows), gap
        elif gap == best_gap and area > 0.5 * side * side * columns * rows:
            best = (columns, rows)
    return best


def tile_count(height: int, width: int, side: int, min_tiles: int, max_tiles: int) -> int:
    """The tiles of an image: its tile grid, plus a thumbnail when the grid has more than one
    tile; one tile without tiling (max_tiles 1)."""
    if max_tiles <= 1:
        return 1
    columns, rows = tile_grid(height, width, side, min_tiles, max_tiles)
    return columns * rows + (columns * rows > 1)


def no_resize(*_: Any, **__: Any) -> tuple[int, int]:
    raise ValueError("InternVL tiles images (Family.tiling); it has no resize rule")


# ----------------------------------------------------------------------------- tiny checkpoints

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# The InternVL -hf chat template: one <IMG_CONTEXT> (and a newline) per image part
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAMED_TOKENS = (
    ("start_image_token", "<img>"),
    ("end_image_token", "</img>"),
    ("context_image_token", "<IMG_CONTEXT>"),
    ("video_token", "<video>"),
)
# 56-pixel tiles of 14-pixel patches: 16 patches and a class token per tile, 4 tokens per tile.
# "qk-norm" is the 6B tower's kind: RMSNorm blocks with RMSNorm over q and k; "heads5" has a
# head count (5, like the 6B tower's 25) that tp 2 and 4 do not divide: padded heads in TP mode.
# "hd64" is InternVL3-1B/2B's InternViT-300M (LayerNorm, head_dim 64) scaled to 2 cores: 4 blocks
# of width 256 over 224-pixel tiles (256 patches, 64 tokens a tile), behind the Qwen2-VL hd64
# decoder (4 layers of width 512, head_dim 64, what a peer's CPU attention needs). "vit-heavy" is
# InternViT-300M's shape scaled to a 2-core CPU (layer-norm blocks, heads of 64, a 4x MLP; 6
# layers of width 256 for 24 of 1024, 224-pixel tiles of 256 patches for 448 of 1024) in front
# of the tiny decoder: its time goes to the tower, for the encoder modes' benchmarks.
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=128, norm_type="layer_norm", use_qk_norm=False),
    "qk-norm": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    intermediate_size=128, norm_type="rms_norm", use_qk_norm=True),
    "heads5": dict(num_hidden_layers=2, hidden_size=80, num_attention_heads=5,
                   intermediate_size=128, norm_type="rms_norm", use_qk_norm=True),
    "hd64": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                 intermediate_size=1024, norm_type="layer_norm", use_qk_norm=False),
    "vit-heavy": dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                      intermediate_size=1024, norm_type="layer_norm", use_qk_norm=False),
}  # fmt: skip
TILE = 56
TILES = {"hd64": 224, "vit-heavy": 224}  # a preset's tile side when not TILE
TEXT_PRESET = {"hd64": "hd64"}  # a preset's Qwen2-VL decoder shape when not the tiny one


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """A published InternVL3 -hf config.json: Qwen2 text_config, InternViT vision_config."""
    text = dict(qwen2_vl.TEXT_SHAPES[TEXT_PRESET.get(preset, "tiny")])
    text.pop("mrope_section")
    tile = TILES.get(preset, TILE)
    text_config = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu", **text, "initializer_range": 0.02, "max_window_layers": 2,
        "model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": dtype,
        "use_cache": True, "use_sliding_window": False,
    }  # fmt: skip
    vision = {
        "architectures": ["InternVisionModel"], "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        **VISION_SHAPES[preset], "image_size": [tile, tile], "initializer_range": 0.02,
        "layer_norm_eps": 1e-06, "layer_scale_init_value": 0.1, "model_type": "internvl_vision",
        "num_channels": 3, "patch_size": [14, 14], "projection_dropout": 0.0,
        "use_absolute_position_embeddings": True, "use_mask_token": False,
        "use_mean_pooling": True,
    }  # fmt: skip
    return {
        "architectures": [ARCHITECTURE], "downsample_ratio": 0.5,
        "image_seq_length": processor_config(preset)["image_seq_length"],
        "image_token_id": ids[TOKENS.image_pad],
        "model_type": "internvl", "projector_hidden_act": "gelu", "text_config": text_config,
        "tie_word_embeddings": False, "torch_dtype": dtype, "vision_config": vision,
        "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
    }  # fmt: skip


def preprocessor_config(preset: str) -> dict[str, Any]:
    """GotOcr2's image processor settings as the -hf checkpoints publish them (the processor,
    not this file, turns tiling on)."""
    tile = TILES.get(preset, TILE)
    return {
        "crop_to_patches": False, "data_format": "channels_first", "default_to_square": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": IMAGENET_MEAN, "image_processor_type": "GotOcr2ImageProcessor",
        "image_std": IMAGENET_STD, "max_patches": 12, "min_patches": 1,
        "processor_class": "InternVLProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"height": tile, "width": tile},
    }  # fmt: skip


def processor_config(preset: str) -> dict[str, Any]:
    """InternVLProcessor's own settings as the -hf checkpoints publish them: the tokens of one
    tile (a processor built from the folder alone, as a peer server builds it, reads them here,
    not from config.json)."""
    tile = TILES.get(preset, TILE)
    return {"image_seq_length": (tile // 14) ** 2 // 4, "processor_class": "InternVLProcessor"}


LAYER_SCALE = (1.0, 0.2)  # (mean, std) of InternViT's per-channel scales on a block's branches


def tiny_init(name: str, shape: tuple[int, ...]) -> tuple[float, float] | None:
    """InternViT's layer scales (`lambda_1`, `lambda_2`) scatter around one; the rest follow
    the shared rule."""
    return LAYER_SCALE if name.rsplit(".", 1)[-1] in ("lambda_1", "lambda_2") else None


TINY = TinyCheckpoint(
    hf_config_class="InternVLConfig",
    hf_processor_class="InternVLProcessor",
    hf_processor_keys=("image_seq_length",),
    init=tiny_init,
    special_tokens=NAMED_TOKENS,
    chat_template=CHAT_TEMPLATE,
    presets=tuple(VISION_SHAPES),
    config=tiny_config,
    preprocessor=preprocessor_config,
    processor=processor_config,
    published_name=lambda name: name,  # published under transformers' own names
)


FAMILY = Family(
    name="internvl",
    architectures=(ARCHITECTURE,),
    text_fields=text_fields,
    vision_fields=vision_fields,
    tower_class="vision.internvl_vit:InternVisionTransformer",
    decoder_class="runtime.models.qwen2:Qwen2ForCausalLM",
    checkpoint_name=checkpoint_name,
    tokens=TOKENS,
    resize=no_resize,
    item_tokens=item_tokens,
    tiny=TINY,
    positions=PositionKind("1d"),
    tiling=Tiling(tile_count),
    modalities=(Modality.IMAGE,),
    refused_media_reason=(  # no oracle for its frames without torchvision
        "not served yet: transformers' InternVLVideoProcessor, the reference for its frames, "
        "needs torchvision"
    ),
)
