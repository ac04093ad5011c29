"""GLM-4.1V (transformers' `Glm4vForConditionalGeneration`, e.g. zai-org/GLM-4.1V-9B-Thinking):
a Qwen-like patch tower (RMSNorm blocks, 2-D rotary, a learned position table interpolated to
each grid, a downsampling merger) and the GLM-4 decoder: MRoPE over a partial rotary dimension
(`partial_rotary_factor`; `mrope_section` sums to head_dim x factor / 2) turning adjacent pairs,
q/k/v bias, RMSNorms after attention and after the MLP, a fused gate_up projection.

The chat template writes `<|begin_of_image|><|image|><|end_of_image|>` per image; the processor
repeats `<|image|>` once per merged patch. Images are resized like Qwen2-VL's, with the pixel
bounds holding for the two frames of a temporal patch (the image is its own second frame).

A video is `<|begin_of_video|><|video|><|end_of_video|>` in the template; Glm4vProcessor writes
each temporal patch in place of `<|video|>` as an image run followed by the whole seconds of its
first frame (`<|begin_of_image|>` + `<|image|>` per token + `<|end_of_image|>` + "3"), each its
own position grid of one frame. Frames are sampled by Glm4vVideoProcessor's rule (one per 1 / fps
seconds, an even count) and resized with the pixel bounds holding for the whole clip, both read
from video_preprocessor_config.json.
"""

from __future__ import annotations

from typing import Any

from runtime.families import qwen2_vl
from runtime.families.base import Family, Fields, MediaTokens, ModelConfigError, VideoStamp
from runtime.families.tiny import TinyCheckpoint
from runtime.multimodal import item_tokens

ARCHITECTURE = "Glm4vForConditionalGeneration"
TOKENS = MediaTokens(
    image_pad="<|image|>", video_pad="<|video|>", start="<|begin_of_image|>",
    end="<|end_of_image|>", start_id_key="image_start_token_id", end_id_key="image_end_token_id",
    video_start="<|begin_of_video|>", video_end="<|end_of_video|>", video_frame_pad="<|image|>",
)  # fmt: skip
VISION_ROPE_THETA = 10000.0  # what vision/vit_common.VisionRotary computes
VIDEO_PROCESSOR = "Glm4vVideoProcessor"


def seconds_after(seconds: float, frame: str) -> str:
    """A temporal patch as Glm4vProcessor writes it: its image run, then its whole seconds."""
    return frame + str(int(seconds))


STAMP = VideoStamp(text=seconds_after, at="first", keep_bounds=True)


def text_fields(text: dict, top: dict) -> Fields:
    """The GLM-4 decoder: head_dim is hidden / heads (transformers ignores a `head_dim` key),
    q/k/v always biased, a partial pairwise rotary, post-norms."""
    fields = qwen2_vl.decoder_fields(text, top)
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if int(text.get("head_dim") or head_dim) != head_dim:
        raise ModelConfigError(f"GLM-4 head_dim must be hidden / heads ({head_dim}), "
                               f"got {text['head_dim']}")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelConfigError(f"GLM-4's decoder rotary must be the default one, got {rope}")
    if text.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"GLM-4's MLP activation must be silu, got {text['hidden_act']}")
    theta, section, _ = qwen2_vl.rope_fields(text)
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor)
    if 2 * sum(section) != rotary_dim:
        raise ModelConfigError(f"mrope_section {section} does not cover the rotary dim "
                               f"{rotary_dim} (head_dim {head_dim} x {factor})")
    return {**fields, "head_dim": head_dim, "attention_bias": True, "rope_theta": theta,
            "mrope_section": section, "rotary_dim": rotary_dim, "rotary_pairs": True,
            "post_norms": True}  # fmt: skip


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    patch, side = int(v.get("patch_size", 14)), int(v.get("image_size", 336))
    out = int(v.get("out_hidden_size", text_hidden))
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", VISION_ROPE_THETA))
    if side % patch or out != text_hidden or theta != VISION_ROPE_THETA:
        raise ModelConfigError(f"GLM-4.1V vision: image_size {side} must be a multiple of "
                               f"patch_size {patch}, out_hidden_size {out} the text hidden size "
                               f"{text_hidden}, rope_theta {theta} {VISION_ROPE_THETA}")
    return dict(
        embed_dim=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        out_hidden_size=out,
        hidden_act=str(v.get("hidden_act", "silu")),
        image_size=side,
        norm_eps=float(v.get("rms_norm_eps", 1e-5)),
        attention_bias=bool(v.get("attention_bias", False)),
        **qwen2_vl.vision_common(v),
    )


def resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 112 * 112,
    max_pixels: int = 14 * 14 * 2 * 2 * 2 * 6144,
    num_frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """Glm4vImageProcessor's rule: Qwen2-VL's smart_resize with the bounds holding for (at
    least) one temporal patch of two frames, a side shorter than `factor` scaled up first."""
    temporal = max(2, temporal_factor)
    frames = max(num_frames, temporal)
    return qwen2_vl.smart_resize(height, width, factor, min_pixels, max_pixels, frames, temporal)


# ----------------------------------------------------------------------------- tiny checkpoints

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
NAMED_TOKENS = (
    ("gmask_token", "[gMASK]"), ("sop_token", "<sop>"), ("system_token", "<|system|>"),
    ("user_token", "<|user|>"), ("assistant_token", "<|assistant|>"),
    ("image_start_token", "<|begin_of_image|>"), ("image_end_token", "<|end_of_image|>"),
    ("image_token", "<|image|>"), ("video_start_token", "<|begin_of_video|>"),
    ("video_end_token", "<|end_of_video|>"), ("video_token", "<|video|>"),
)  # fmt: skip
# head_dim 16 with a half rotary: 4 frequencies, in sections [2, 1, 1]. The position table is
# 8 x 8 patches (112 px), so test images both shrink and stretch it.
# "hd64" is GLM-4.1V-9B scaled to 2 cores with head_dim 64 in both towers (what a peer's CPU
# attention needs): a 4-layer 512-wide decoder (rotary over half of each head, sections
# [4, 6, 6] as the published [8, 12, 12] halved) behind a 4-block 256-wide tower whose position
# table is the published 24 x 24 patches (336 px).
TEXT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 max_position_embeddings=4096, mrope_section=[2, 1, 1]),
    "hd64": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1536, vocab_size=512,
                 max_position_embeddings=8192, mrope_section=[4, 6, 6]),
}  # fmt: skip
TEXT_SHAPES["vit-heavy"] = TEXT_SHAPES["tiny"]
# "vit-heavy": GLM-4.1V's tower scaled to a 2-core CPU (24 blocks of width 1536, heads of 128, a
# 336-pixel position table) as 6 blocks of width 256 in 4 heads of 64 with a 4x MLP and the same
# 24 x 24 position table, in front of the tiny decoder: its time goes to the tower.
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=64,
                 image_size=112),
    "hd64": dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=1536,
                 out_hidden_size=512, image_size=336),
    "vit-heavy": dict(depth=6, hidden_size=256, num_heads=4, intermediate_size=1024,
                      out_hidden_size=64, image_size=336),
}  # fmt: skip


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """A GLM-4.1V config.json as transformers 5.x writes it: nested text and vision configs."""
    text = dict(TEXT_SHAPES[preset])
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": text.pop("mrope_section"), "partial_rotary_factor": 0.5}
    text_config = {
        "model_type": "glm4v_text", **text, "attention_bias": True, "attention_dropout": 0.0,
        "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-05,
        "rope_parameters": rope, "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"], "tie_word_embeddings": False, "use_cache": True,
        "dtype": dtype,
    }  # fmt: skip
    vision = {
        "model_type": "glm4v_vision", **VISION_SHAPES[preset], "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "in_channels": 3,
        "initializer_range": 0.02, "patch_size": 14, "rms_norm_eps": 1e-05,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
        "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
    }  # fmt: skip
    return {
        "architectures": [ARCHITECTURE], "model_type": "glm4v", **TOKENS.config_ids(ids),
        "text_config": text_config,
        "vision_config": vision, "tie_word_embeddings": False, "dtype": dtype,
    }  # fmt: skip


def preprocessor_config(preset: str) -> dict[str, Any]:
    """Glm4vImageProcessor's settings: pixel bounds as `size`, CLIP mean and std."""
    return {
        "size": {"shortest_edge": 3136, "longest_edge": 200704}, "do_rescale": True,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": qwen2_vl.CLIP_MEAN, "image_std": qwen2_vl.CLIP_STD,
        "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor",
    }  # fmt: skip


def video_preprocessor_config(preset: str) -> dict[str, Any]:
    """Glm4vVideoProcessor's settings: pixel bounds per clip as `size` (the published ones at
    the tiny preset too), frames at `fps` up to `max_duration` seconds."""
    return {
        "size": {"shortest_edge": 12544, "longest_edge": 47040000},
        "max_image_size": {"longest_edge": 47040000}, "do_rescale": True, "do_resize": True,
        "do_sample_frames": True, "fps": 2, "max_duration": 300, "num_frames": 16,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": qwen2_vl.CLIP_MEAN, "image_std": qwen2_vl.CLIP_STD,
        "video_processor_type": VIDEO_PROCESSOR, "processor_class": "Glm4vProcessor",
    }  # fmt: skip


TINY = TinyCheckpoint(
    presets=tuple(VISION_SHAPES), config=tiny_config, preprocessor=preprocessor_config,
    hf_config_class="Glm4vConfig", hf_processor_class="Glm4vProcessor",
    special_tokens=NAMED_TOKENS, chat_template=CHAT_TEMPLATE,
    published_name=lambda name: name,  # published under transformers' own names
    video_preprocessor=video_preprocessor_config,
)  # fmt: skip


FAMILY = Family(
    name="glm4v", architectures=(ARCHITECTURE,), timestamped_video=True, video_stamp=STAMP,
    video_sampling="interval", clip_budget_video_processors=(VIDEO_PROCESSOR,),
    reasoning_parser="glm45",  # GLM-4.1V-Thinking: <think>...</think><answer>...</answer>
    text_fields=text_fields, vision_fields=vision_fields,
    tower_class="vision.glm4v_vit:Glm4vVisionTransformer",
    decoder_class="runtime.models.qwen2:Qwen2ForCausalLM",  # with GLM-4's switches
    checkpoint_name=qwen2_vl.checkpoint_name,  # model.language_model.* / model.* alike
    tokens=TOKENS, resize=resize, item_tokens=item_tokens, tiny=TINY,
)  # fmt: skip
