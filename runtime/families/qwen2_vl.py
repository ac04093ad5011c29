"""Qwen2-VL: flat or nested config, MRoPE in blocks, LayerNorm ViT with quick_gelu MLPs.

Its config readers are the base the other Qwen families build on (`text_fields` with the Qwen3
switches, `vision_common`).
"""

from __future__ import annotations

import math

from runtime.families.base import Family, Fields, MediaTokens, ModelConfigError, check_aspect_ratio
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
    tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    if 2 * sum(section) != head_dim:
        raise ModelConfigError(f"mrope_section {section} does not cover head_dim {head_dim}")
    return dict(
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        intermediate_size=int(text["intermediate_size"]),
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        head_dim=head_dim,
        mrope_interleaved=interleaved,
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


def vision_fields(v: dict, text_hidden: int) -> Fields:
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


FAMILY = Family(
    name="qwen2_vl",
    architectures=("Qwen2VLForConditionalGeneration",),
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
)
