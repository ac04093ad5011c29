"""Gemma 3 (transformers' `Gemma3ForConditionalGeneration`, e.g. google/gemma-3-4b-it): a SigLIP
tower over one fixed-size image (no class token, a learned position per patch), its patch grid
average-pooled to `mm_tokens_per_image` soft tokens, a projector (RMSNorm with `(1 + w)`, then
one matrix) and the Gemma 3 decoder (runtime/models/gemma3.py): q/k norms, `(1 + w)` RMSNorms,
embeddings scaled by sqrt(hidden), GeGLU, norms before and after the attention and the MLP,
`query_pre_attn_scalar` scaling, interleaved sliding-window and global layers with their own
RoPE bases, tied embeddings, optional final logit softcapping. Positions are plain 1-D.

The chat template writes `<start_of_image>` per image; the processor expands it to
`\\n\\n<start_of_image>` + `<image_soft_token>` x N + `<end_of_image>\\n\\n`. The soft tokens of one
image attend to each other both ways (image attention "bidirectional_item"). An image is one
tile of `image_size` pixels; with pan-and-scan (a request's `do_pan_and_scan`) a long image
also gives 2 to 4 crops, each a tile of its own run after the whole image's
(Family.tiling: `crop_count`, `crop_text`), each run attending both ways within itself only,
as transformers' token-type mask has it.

Two config layouts are read: the published one (`rope_local_base_freq`, `rope_scaling` for the
global layers, `sliding_window_pattern`) and transformers 5.x's (`layer_types`, and
`rope_parameters` per layer type).
"""

from __future__ import annotations

import math
from typing import Any

from runtime.families import base, internvl, qwen2_vl
from runtime.families.base import Family, Fields, MediaTokens, ModelConfigError
from runtime.families.tiny import TinyCheckpoint
from runtime.multimodal import Modality, item_tokens

ARCHITECTURE = "Gemma3ForConditionalGeneration"
TOKENS = MediaTokens(
    image_pad="<image_soft_token>", video_pad="", start="<start_of_image>",
    end="<end_of_image>", image_id_key="image_token_index", start_id_key="boi_token_index",
    end_id_key="eoi_token_index", template_wraps=False, template_mark="<start_of_image>",
    surround="\n\n",
)  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(text: dict) -> list[str]:
    """Each layer's kind: `layer_types`, else every `sliding_window_pattern`-th layer global."""
    layers = int(text["num_hidden_layers"])
    kinds = text.get("layer_types")
    if kinds is None:
        pattern = int(text.get("sliding_window_pattern", text.get("_sliding_window_pattern", 6)))
        kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {SLIDING, FULL}:
        raise ModelConfigError(
            f"Gemma 3 layer_types {kinds} must name {layers} layers of {SLIDING!r} or {FULL!r}"
        )
    return list(kinds)


def rope_of(text: dict, kind: str) -> tuple[float, float]:
    """(theta, linear scaling factor) of a layer kind's rotary, from either layout."""
    params = text.get("rope_parameters") or {}
    rope = params.get(kind) if isinstance(params.get(kind), dict) else None
    if rope is None and kind == SLIDING:
        rope = {"rope_type": "default", "rope_theta": text.get("rope_local_base_freq", 10000.0)}
    if rope is None:
        scaling = text.get("rope_scaling") or (params if "rope_type" in params else {})
        rope = {**scaling, "rope_theta": text.get("rope_theta", params.get("rope_theta", 1e6))}
    kind_name = rope.get("rope_type", rope.get("type", "default"))
    if kind_name not in ("default", "linear"):
        raise ModelConfigError(f"Gemma 3 {kind} rotary must be default or linear, got {rope}")
    factor = float(rope.get("factor", 1.0)) if kind_name == "linear" else 1.0
    return float(rope["rope_theta"]), factor


def text_fields(text: dict, top: dict) -> Fields:
    fields = qwen2_vl.decoder_fields(text, top)
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if text.get(key):
            raise ModelConfigError(f"Gemma 3 {key}={text[key]!r} is not supported")
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(f"Gemma 3's MLP activation must be gelu_pytorch_tanh, got {act}")
    kinds = layer_types(text)
    window = int(text.get("sliding_window") or 4096)
    tokens = int(top.get("mm_tokens_per_image", 256))
    if SLIDING in kinds and tokens > window:  # the rule below holds only inside the window
        raise ModelConfigError(f"mm_tokens_per_image {tokens} exceeds the sliding window {window}")
    (theta, factor), (local_theta, local_factor) = rope_of(text, FULL), rope_of(text, SLIDING)
    if local_factor != 1.0:
        raise ModelConfigError("Gemma 3's sliding layers take plain RoPE")
    cap = text.get("final_logit_softcapping")
    return {**fields, "qk_norm": True, "post_norms": True,
            "attention_bias": bool(text.get("attention_bias", False)),
            "tie_word_embeddings": bool(text.get("tie_word_embeddings",
                                                 top.get("tie_word_embeddings", True))),
            "rope_theta": theta, "mrope_section": (fields["head_dim"] // 2,),
            "sliding_windows": tuple(window if k == SLIDING else 0 for k in kinds),
            "rope_local_theta": local_theta, "rope_linear_factor": factor,
            "query_pre_attn_scalar": float(text.get("query_pre_attn_scalar", fields["head_dim"])),
            "final_logit_softcapping": float(cap or 0.0)}  # fmt: skip


def vision_fields(v: dict, text_hidden: int, top: dict | None = None) -> Fields:
    top = top or {}
    patch, side = int(v.get("patch_size", 14)), int(v.get("image_size", 896))
    per_side = side // patch
    tokens = int(top.get("mm_tokens_per_image", 256))
    pooled = round(tokens**0.5)
    if side % patch or pooled**2 != tokens or per_side % pooled:
        raise ModelConfigError(
            f"Gemma 3 vision: {side} px images of {patch} px patches cannot "
            f"pool to mm_tokens_per_image {tokens}"
        )
    if v.get("vision_use_head"):
        raise ModelConfigError("Gemma 3's SigLIP tower has no pooling head (vision_use_head)")
    fields = internvl.tile_tower_fields(v, text_hidden, patch, side, per_side // pooled)
    return {**fields, "hidden_act": str(v.get("hidden_act", "gelu_pytorch_tanh"))}


# Checkpoint tensor prefixes of the published layouts -> the composite's names. The decoder's
# four norms take the names of the decoder's post-norm switch (runtime/models/qwen2.py).
# InternVL's LLaVA-style prefixes, with the SigLIP tower's `vision_model.` level dropped first.
PREFIXES = (
    ("model.vision_tower.vision_model.", "visual."),
    ("vision_tower.vision_model.", "visual."),
    *internvl.PREFIXES,
)
NORMS = {
    "post_attention_layernorm": "post_self_attn_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "post_mlp_layernorm",
}


def checkpoint_name(name: str) -> str:
    name = internvl.renamed(name, PREFIXES)
    parts = name.split(".")
    return ".".join(NORMS.get(p, p) if name.startswith("model.") else p for p in parts)


# Pan-and-scan (Gemma3Processor's own settings, which it passes over the image processor's):
# an image whose aspect ratio reaches CROP_RATIO is cut along its long side into 2 to
# MAX_CROPS crops of at least MIN_CROP px a side, each encoded as the whole image is.
MIN_CROP, MAX_CROPS, CROP_RATIO = 256, 4, 1.2


def crop_grid(height: int, width: int, max_crops: int = MAX_CROPS) -> tuple[int, int]:
    """(rows, columns) of an image's pan-and-scan crops, (0, 0) without any (pure; the rule of
    transformers' Gemma3ImageProcessor.pan_and_scan)."""
    long, short = max(height, width), min(height, width)
    if long / short < CROP_RATIO:
        return 0, 0
    count = min(int(math.floor(long / MIN_CROP)), int(math.floor(long / short + 0.5)))
    count = min(max_crops, max(2, count))
    crop_long, crop_short = math.ceil(long / count), short
    if min(crop_long, crop_short) < MIN_CROP:
        return 0, 0
    return (1, count) if width >= height else (count, 1)


def crop_count(height: int, width: int, side: int, min_tiles: int, max_tiles: int) -> int:
    """Tiles of an image: the whole image, and its crops when pan-and-scan is on (max_tiles,
    the whole image and at most max_tiles - 1 crops, above 1)."""
    if max_tiles <= 1:
        return 1
    rows, columns = crop_grid(height, width, max_tiles - 1)
    return 1 + rows * columns


def crop_kwargs(min_tiles: int, max_tiles: int) -> dict[str, Any]:
    if max_tiles <= 1:
        return {"do_pan_and_scan": False}
    return {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": MIN_CROP,
            "pan_and_scan_max_num_crops": max_tiles - 1,
            "pan_and_scan_min_ratio_to_activate": CROP_RATIO}  # fmt: skip


def crop_text(run: str, tiles: int) -> str:
    """Gemma3Processor's text of an image with crops: the whole image's run, then each crop's."""
    if tiles == 1:
        return run
    crops = " ".join([run] * (tiles - 1))
    return (f"Here is the original image {run} and here are some crops to help you see "
            f"better {crops}")  # fmt: skip


CROPS_KEY = "pan_and_scan_max_num_crops"
TILING = base.Tiling(crop_count, crop_kwargs, keys=("do_pan_and_scan", CROPS_KEY),
                     switched_on=1 + MAX_CROPS, crops_key=CROPS_KEY,
                     tile_text=crop_text)  # fmt: skip


def no_resize(*_: Any, **__: Any) -> tuple[int, int]:
    raise ValueError("Gemma 3 encodes images at one fixed size (Family.tiling); no resize rule")


# ----------------------------------------------------------------------------- tiny checkpoints

# The Gemma 3 instruct chat template: a system message joins the first user turn, the assistant
# is "model", every image part is one <start_of_image>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}"
    "{% endif %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
NAMED_TOKENS = (
    ("bos_token", "<bos>"), ("eos_token", "<eos>"), ("pad_token", "<pad>"),
    ("sot_token", "<start_of_turn>"), ("eot_token", "<end_of_turn>"),
    ("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
    ("image_token", "<image_soft_token>"),
)  # fmt: skip
# Newline runs Gemma's tokenizer holds as single pieces (a peer's Gemma 3 processor looks them up)
NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
SIGLIP_MEAN = [0.5, 0.5, 0.5]
# 112 px images of 14 px patches (8 x 8), pooled 2 x 2 to 16 soft tokens; three decoder layers,
# two sliding (window 24, longer than an image, shorter than a two-image prompt) and one global
# with a linear RoPE scaling. hd64: head_dim 64 in the decoder (what a peer's CPU attention takes).
# "vit-heavy": google/gemma-3-4b-it's SigLIP tower (27 layers of width 1152, 16 heads of 72, MLP
# 4304, 896 px images of 14 px patches, 4096 patches pooled 4 x 4 to 256 soft tokens) scaled to a
# 2-core CPU as InternVL's vit-heavy scales InternViT: 6 layers, a quarter of the width (288, in
# 4 heads of the published 72, MLP 1076), 448 px images (1024 patches, a quarter) pooled 2 x 2 to
# the published 256 soft tokens; in front of the tiny decoder (its window widened past an
# image's 260 tokens), so its time goes to the tower, for the encoder modes' benchmarks.
TEXT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 sliding_window_pattern=3, sliding_window=24, query_pre_attn_scalar=16),
    "hd64": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512,
                 sliding_window_pattern=2, sliding_window=64, query_pre_attn_scalar=64),
}  # fmt: skip
TEXT_SHAPES["vit-heavy"] = {**TEXT_SHAPES["tiny"], "sliding_window": 320}
VISION_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4),
    "hd64": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2),
    "vit-heavy": dict(hidden_size=288, intermediate_size=1076, num_hidden_layers=6,
                      num_attention_heads=4),
}  # fmt: skip
IMAGE_SIZE, SOFT_TOKENS = 112, 16
IMAGES = {"vit-heavy": (448, 256)}  # a preset's (image side, soft tokens) when not the above


def image_shape(preset: str) -> tuple[int, int]:
    """(image side in px, soft tokens per image) of a preset."""
    return IMAGES.get(preset, (IMAGE_SIZE, SOFT_TOKENS))


def tiny_config(preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """A config.json in google/gemma-3-4b-it's published layout."""
    side, soft_tokens = image_shape(preset)
    text = {
        "model_type": "gemma3_text", **TEXT_SHAPES[preset], "vocab_size": 512,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "max_position_embeddings": 131072, "attention_bias": False,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }  # fmt: skip
    vision = {
        "model_type": "siglip_vision_model", **VISION_SHAPES[preset], "image_size": side,
        "patch_size": 14, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-06, "attention_dropout": 0.0, "vision_use_head": False,
    }  # fmt: skip
    return {
        "architectures": [ARCHITECTURE], "model_type": "gemma3",
        "boi_token_index": ids[TOKENS.start], "eoi_token_index": ids[TOKENS.end],
        "image_token_index": ids[TOKENS.image_pad], "mm_tokens_per_image": soft_tokens,
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "initializer_range": 0.02,
        "text_config": text, "vision_config": vision, "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }  # fmt: skip


def preprocessor_config(preset: str) -> dict[str, Any]:
    """Gemma3ImageProcessor's published settings, at the preset's image size."""
    side, soft_tokens = image_shape(preset)
    return {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None,
        "do_rescale": True, "do_resize": True, "image_mean": SIGLIP_MEAN,
        "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": soft_tokens,
        "image_std": SIGLIP_MEAN, "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor", "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": side, "width": side},
    }  # fmt: skip


# transformers' in-memory names -> the published ones (language_model.model.*, vision_model)
PUBLISHED = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def published_name(name: str) -> str:
    for new, old in PUBLISHED:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def tiny_init(name: str, shape: tuple[int, ...]) -> tuple[float, float] | None:
    """The decoder's and projector's norms scale by 1 + w: their w scatter around zero (a
    scale near one, as the shared rule's norms have); the embedding is multiplied by
    sqrt(hidden) before use: drawn that much smaller, so text rows stay of the shared rule's
    size next to the attention and MLP outputs (else every step repeats the last token)."""
    if name.endswith("norm.weight") and not name.startswith("vision_tower."):
        return 0.0, 0.1
    if name.endswith("embed_tokens.weight"):
        return 0.0, 0.375 / shape[1] ** 0.5
    return None


TINY = TinyCheckpoint(
    presets=tuple(TEXT_SHAPES), config=tiny_config, preprocessor=preprocessor_config,
    hf_config_class="Gemma3Config", special_tokens=NAMED_TOKENS, chat_template=CHAT_TEMPLATE,
    published_name=published_name, pieces=NEWLINES, eos_tokens=("<eos>", "<end_of_turn>"),
    init=tiny_init,
    bos_token="<bos>",
)  # fmt: skip


FAMILY = Family(
    name="gemma3", architectures=(ARCHITECTURE,), modalities=(Modality.IMAGE,),
    text_fields=text_fields, vision_fields=vision_fields,
    tower_class="vision.siglip_vit:SiglipVisionTower",
    decoder_class="runtime.models.gemma3:Gemma3ForCausalLM",
    checkpoint_name=checkpoint_name, tokens=TOKENS, resize=no_resize, item_tokens=item_tokens,
    tiny=TINY, positions=base.PositionKind("1d"), tiling=TILING,
    image_attention="bidirectional_item",
)  # fmt: skip
