"""Qwen3-VL: nested config with interleaved MRoPE, the Qwen3 decoder (RMSNorm over q and k, no
q/k/v bias), a ViT with a learned position table whose DeepStack blocks feed the first decoder
layers, and timestamped videos."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from runtime.families import qwen2_vl
from runtime.families.base import Fields, ModelConfigError
from runtime.families.tiny import TinyCheckpoint

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
TOKENS = qwen2_vl.FAMILY.tokens


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    positions = int(v.get("num_position_embeddings", 2304))
    if round(positions**0.5) ** 2 != positions:
        raise ModelConfigError(f"num_position_embeddings {positions} is not a square grid")
    return dict(
        embed_dim=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        out_hidden_size=int(v.get("out_hidden_size", text_hidden)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        num_position_embeddings=positions,
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
        patch_bias=True,
        **qwen2_vl.vision_common(v),
    )


# ----------------------------------------------------------------------------- tiny checkpoints

PROCESSOR_CLASS = "Qwen3VLProcessor"
HALF = [0.5, 0.5, 0.5]  # normalised with mean 0.5 and std 0.5

# head_dim is its own setting (not hidden / heads), MRoPE sections are interleaved, and
# the vision blocks listed in deepstack_visual_indexes feed the first decoder layers. The tiny
# decoder has more layers than DeepStack levels, so one layer runs after the last injection.
TEXT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=4096,
        mrope_section=[4, 4, 4],
    ),
    "7b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        max_position_embeddings=262144,
        mrope_section=[24, 20, 20],
    ),
}
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        depth=3,
        hidden_size=64,
        num_heads=4,
        intermediate_size=128,
        out_hidden_size=64,
        num_position_embeddings=36,
        deepstack_visual_indexes=[0, 1],
    ),
    "7b": dict(
        depth=27,
        hidden_size=1152,
        num_heads=16,
        intermediate_size=4304,
        out_hidden_size=4096,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    ),
}


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """A Qwen3-VL config.json: nested text_config with `rope_scaling` (interleaved MRoPE)."""
    text = dict(TEXT_SHAPES[preset])
    section = text.pop("mrope_section")
    rope = {"mrope_interleaved": True, "mrope_section": section, "rope_type": "default"}
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "dtype": dtype,
        "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu",
        **text,
        "initializer_range": 0.02,
        "model_type": "qwen3_vl_text",
        "rms_norm_eps": 1e-06,
        "rope_scaling": rope,
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    vision = {
        **VISION_SHAPES[preset],
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "initializer_range": 0.02,
        "model_type": "qwen3_vl",
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": [ARCHITECTURE],
        **TOKENS.config_ids(ids),
        "model_type": "qwen3_vl",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "vision_config": vision,
    }


def preprocessor_config(preset: str) -> dict[str, Any]:
    """Qwen3-VL: 16-pixel patches, mean/std 0.5, pixel bounds as `size`."""
    longest = 200704 if preset == "tiny" else 16777216
    return {
        "size": {"shortest_edge": 4096 if preset == "tiny" else 65536, "longest_edge": longest},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": HALF,
        "image_std": HALF,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": PROCESSOR_CLASS,
    }


def video_preprocessor_config(preset: str) -> dict[str, Any]:
    """Qwen3-VL's separate video processor settings (frames sampled at `fps`, timestamped)."""
    return {
        "size": {"shortest_edge": 4096, "longest_edge": 200704 if preset == "tiny" else 25165824},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": HALF,
        "image_std": HALF,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": PROCESSOR_CLASS,
    }


TINY = TinyCheckpoint(
    presets=tuple(VISION_SHAPES),
    config=tiny_config,
    preprocessor=preprocessor_config,
    hf_config_class="Qwen3VLConfig",
    published_name=lambda name: name,  # published under transformers' own names
    video_preprocessor=video_preprocessor_config,
)


FAMILY = dataclasses.replace(
    qwen2_vl.FAMILY,
    name="qwen3_vl",
    architectures=(ARCHITECTURE,),
    text_fields=functools.partial(qwen2_vl.text_fields, qk_norm=True),
    vision_fields=vision_fields,
    tower_class="vision.qwen3_vl_vit:Qwen3VisionTransformer",
    clip_budget_video_processors=("Qwen3VLVideoProcessor",),
    timestamped_video=True,
    tiny=TINY,
)
