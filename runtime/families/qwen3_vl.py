"""Qwen3-VL: nested config with interleaved MRoPE, the Qwen3 decoder (RMSNorm over q and k, no
q/k/v bias), a ViT with a learned position table whose DeepStack blocks feed the first decoder
layers, and timestamped videos."""

from __future__ import annotations

import dataclasses
import functools

from runtime.families import qwen2_vl
from runtime.families.base import Fields, ModelConfigError


def vision_fields(v: dict, text_hidden: int) -> Fields:
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


FAMILY = dataclasses.replace(
    qwen2_vl.FAMILY,
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    text_fields=functools.partial(qwen2_vl.text_fields, qk_norm=True),
    vision_fields=vision_fields,
    tower_class="vision.qwen3_vl_vit:Qwen3VisionTransformer",
    clip_budget_video_processors=("Qwen3VLVideoProcessor",),
    timestamped_video=True,
)
