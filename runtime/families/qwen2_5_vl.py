"""Qwen2.5-VL: Qwen2-VL's decoder and config layout; an RMSNorm ViT with gated MLPs and window
attention, and time-scaled temporal positions for videos (`tokens_per_second`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime.families import qwen2_vl
from runtime.families.base import Fields, PositionKind
from runtime.families.tiny import TinyCheckpoint


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    return dict(
        embed_dim=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        out_hidden_size=int(v.get("out_hidden_size", text_hidden)),
        hidden_act=str(v.get("hidden_act", "silu")),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        tokens_per_second=float(v.get("tokens_per_second", 2)),
        **qwen2_vl.vision_common(v),
    )


# ----------------------------------------------------------------------------- tiny checkpoints

VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        depth=2,
        hidden_size=64,
        num_heads=4,
        intermediate_size=128,
        out_hidden_size=64,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
        hidden_act="silu",
    ),
    "vit-hd64": dict(
        depth=6,
        hidden_size=320,
        num_heads=4,
        intermediate_size=1280,
        out_hidden_size=256,
        window_size=112,
        fullatt_block_indexes=[2, 5],
        tokens_per_second=2,
        hidden_act="silu",
    ),
    "7b": dict(
        depth=32,
        hidden_size=1280,
        num_heads=16,
        intermediate_size=3420,
        out_hidden_size=3584,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
        hidden_act="silu",
    ),
}


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """Qwen2-VL's flat layout; the tiny preset ties its embeddings, 7b has 128k positions."""
    config = qwen2_vl.flat_config("qwen2_5_vl", VISION_SHAPES[preset], preset, ids, dtype)
    if preset == "7b":
        config["max_position_embeddings"] = 128000
    config["tie_word_embeddings"] = preset == "tiny"
    return config


TINY = TinyCheckpoint(
    presets=tuple(VISION_SHAPES),
    config=tiny_config,
    preprocessor=lambda preset: qwen2_vl.preprocessor_config("qwen2_5_vl", preset),
    hf_config_class="Qwen2_5_VLConfig",
    published_name=qwen2_vl.checkpoint_name,
)


FAMILY = dataclasses.replace(
    qwen2_vl.FAMILY,
    name="qwen2_5_vl",
    architectures=(qwen2_vl.ARCHITECTURE["qwen2_5_vl"],),
    vision_fields=vision_fields,
    tower_class="vision.qwen2_5_vl_vit:Qwen2_5_VisionTransformer",
    positions=PositionKind("mrope", time_scaled_video=True),
    tiny=TINY,
)
