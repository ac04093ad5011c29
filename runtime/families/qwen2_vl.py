"""Qwen2-VL: flat or nested config, MRoPE in blocks, LayerNorm ViT with quick_gelu MLPs.

Its config readers are the base the other Qwen families build on (`text_fields` with the Qwen3
switches, `vision_common`).
"""

from __future__ import annotations

import math
from typing import Any

from runtime.families.base import Family, Fields, MediaTokens, ModelConfigError, check_aspect_ratio
from runtime.families.tiny import TinyCheckpoint, is_small
from runtime.multimodal import item_tokens


def rope_fields(text: dict) -> tuple[float, tuple[int, ...], bool]:
    """(theta, mrope_section, interleaved) from `rope_scaling` or `rope_parameters`."""
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    section = rope.get("mrope_section")
    if not section:
        raise ModelConfigError("config has no mrope_section (rope_scaling / rope_parameters)")
    return float(theta), tuple(int(s) for s in section), bool(rope.get("mrope_interleaved"))


def text_fields(text: dict, top: dict, qk_norm: bool = False) -> Fields:
    """`text`: the text fields (text_config, or the whole config when flat); `top`: the config.
    `qk_norm` (Qwen3's decoder) also turns the q/k/v bias off unless the config says otherwise."""
    theta, section, interleaved = rope_fields(text)
    fields = decoder_fields(text, top, qk_norm)
    if 2 * sum(section) != fields["head_dim"]:
        raise ModelConfigError(f"mrope_section {section} does not cover head_dim "
                               f"{fields['head_dim']}")
    return {**fields, "rope_theta": theta, "mrope_section": section,
            "mrope_interleaved": interleaved}


def decoder_fields(text: dict, top: dict, qk_norm: bool = False) -> Fields:
    """The Qwen2 / Qwen3 decoder's fields other than its rotary ones."""
    tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    heads = int(text["num_attention_heads"])
    return dict(
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        intermediate_size=int(text["intermediate_size"]),
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
        qk_norm=qk_norm,
        attention_bias=bool(text.get("attention_bias", not qk_norm)),
    )


def vision_common(v: dict) -> Fields:
    """The vision fields every Qwen tower reads alike."""
    return dict(
        depth=int(v["depth"]),
        num_heads=int(v["num_heads"]),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_chans", v.get("in_channels", 3))),
    )


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    embed = int(v["embed_dim"])
    return dict(
        embed_dim=embed,
        intermediate_size=int(embed * float(v.get("mlp_ratio", 4))),
        out_hidden_size=int(v.get("hidden_size", text_hidden)),
        hidden_act=str(v.get("hidden_act", "quick_gelu")),
        **vision_common(v),
    )


def checkpoint_name(name: str) -> str:
    """transformers 5.x's saved names (`model.language_model.*`, `model.visual.*`) onto the
    older published layout (`model.*`, `visual.*`), which passes unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
    num_frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect kept.

    With `num_frames` and `temporal_factor` (Qwen3-VL videos) the bounds hold for the clip: the
    frame count rounded to whole temporal patches times the frame's pixels; a frame side shorter
    than `factor` is first scaled up to it (aspect kept)."""
    if height < 1 or width < 1:
        raise ValueError(f"image is too small to resize: {height}x{width}")
    if temporal_factor > 1 and min(height, width) < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:
        raise ValueError(f"image is too small to resize: {height}x{width} -> {h_bar}x{w_bar}")
    return h_bar, w_bar


# ----------------------------------------------------------------------------- tiny checkpoints

ARCHITECTURE = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
PROCESSOR_CLASS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

TEXT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=4096,
        mrope_section=[2, 3, 3],
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        mrope_section=[16, 24, 24],
    ),
}

TEXT_SHAPES["vit-heavy"] = TEXT_SHAPES["tiny"]
TEXT_SHAPES["hd64"] = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1536,
    vocab_size=512,
    max_position_embeddings=8192,
    mrope_section=[8, 12, 12],
)
TEXT_SHAPES["vit-hd64"] = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    vocab_size=512,
    max_position_embeddings=8192,
    mrope_section=[8, 12, 12],
)
TEXT_SHAPES["100m"] = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=2048,
    vocab_size=512,
    max_position_embeddings=8192,
    mrope_section=[8, 12, 12],
)

VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2, hidden_size=64),
    "vit-heavy": dict(depth=4, embed_dim=320, num_heads=4, mlp_ratio=4, hidden_size=64),
    "hd64": dict(depth=4, embed_dim=256, num_heads=4, mlp_ratio=4, hidden_size=512),
    "100m": dict(depth=8, embed_dim=512, num_heads=8, mlp_ratio=4, hidden_size=768),
    "7b": dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=3584),
}


def flat_config(
    family: str, vision: dict[str, Any], preset: str, ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    """The config.json of a published Qwen2-VL / Qwen2.5-VL checkpoint: text fields at the top
    level; `vision`: the preset's vision tower shape."""
    text = dict(TEXT_SHAPES[preset])
    mrope_section = text.pop("mrope_section")
    return {
        "architectures": [ARCHITECTURE[family]],
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        **text,
        "initializer_range": 0.02,
        "max_window_layers": text["num_hidden_layers"],
        "model_type": family,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": vision_config(vision),
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section},
    }


def vision_config(vision: dict[str, Any]) -> dict[str, Any]:
    common = dict(
        in_chans=3,
        patch_size=14,
        spatial_merge_size=2,
        spatial_patch_size=14,
        temporal_patch_size=2,
    )
    return {**vision, **common}


def preprocessor_config(family: str, preset: str) -> dict[str, Any]:
    return {
        "min_pixels": 3136,
        "max_pixels": 200704 if is_small(preset) else 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": PROCESSOR_CLASS[family],
    }


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    return flat_config("qwen2_vl", VISION_SHAPES[preset], preset, ids, dtype)


TINY = TinyCheckpoint(
    presets=tuple(VISION_SHAPES),
    config=tiny_config,
    preprocessor=lambda preset: preprocessor_config("qwen2_vl", preset),
    hf_config_class="Qwen2VLConfig",
    published_name=checkpoint_name,
)


FAMILY = Family(
    name="qwen2_vl",
    architectures=(ARCHITECTURE["qwen2_vl"],),
    text_fields=text_fields,
    vision_fields=vision_fields,
    tower_class="vision.qwen2_vl_vit:Qwen2VisionTransformer",
    decoder_class="runtime.models.qwen2:Qwen2ForCausalLM",
    checkpoint_name=checkpoint_name,
    tokens=MediaTokens(
        image_pad="<|image_pad|>",
        video_pad="<|video_pad|>",
        start="<|vision_start|>",
        end="<|vision_end|>",
    ),
    resize=smart_resize,
    item_tokens=item_tokens,
    tiny=TINY,
)
