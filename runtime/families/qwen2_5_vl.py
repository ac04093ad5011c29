"""Qwen2.5-VL: Qwen2-VL's decoder and config layout; an RMSNorm ViT with gated MLPs and window
attention, and time-scaled temporal positions for videos (`tokens_per_second`)."""

from __future__ import annotations

import dataclasses

from runtime.families import qwen2_vl
from runtime.families.base import Fields, PositionKind


def vision_fields(v: dict, text_hidden: int) -> Fields:
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


FAMILY = dataclasses.replace(
    qwen2_vl.FAMILY,
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    vision_fields=vision_fields,
    tower_class="vision.qwen2_5_vl_vit:Qwen2_5_VisionTransformer",
    positions=PositionKind("mrope", time_scaled_video=True),
)
