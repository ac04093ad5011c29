"""Typed view of a checkpoint's config.json.

Two layouts exist in the wild: the flat one of the published Qwen2-VL / Qwen2.5-VL repositories
(text fields at the top level, `rope_scaling: {"type": "mrope", ...}`, `in_chans`), and the nested
one that transformers 5.x writes (`text_config`, `rope_parameters`) and that the published Qwen3-VL
repositories use (`text_config` with `rope_scaling: {"mrope_interleaved": true, ...}`). Every
family parses from either layout to the same object; what each family reads is declared in its
module under runtime/families/ (`Family.text_fields`, `Family.vision_fields`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtime.families import Family, family_for, get_family
from runtime.families.base import ModelConfigError

__all__ = ["GenerationDefaults", "ModelConfig", "ModelConfigError", "TextConfig", "VisionConfig"]


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    head_dim: int
    mrope_interleaved: bool = False  # Qwen3-VL: T/H/W frequencies interleaved, not in blocks
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary
    attention_bias: bool = True  # bias on the q/k/v projections (Qwen2: yes, Qwen3: no)
    # GLM-4: only the first rotary_dim dims of a head turn (0: all), as adjacent pairs
    # (`rotary_pairs`) rather than halves; RMSNorms on the attention and MLP outputs
    rotary_dim: int = 0
    rotary_pairs: bool = False
    post_norms: bool = False
    # Gemma 3: each layer's sliding window (0: a global layer), the sliding layers' RoPE base,
    # the global layers' linear RoPE scaling, q scaled by query_pre_attn_scalar**-0.5 (0: by
    # head_dim), tanh softcapping of the final logits (0: none)
    sliding_windows: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    rope_linear_factor: float = 1.0
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 1.0
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table, a square grid
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks that feed DeepStack
    patch_bias: bool = False  # Qwen3-VL's patch embedding has a bias
    # Towers with a class token and fixed-size tiles (InternViT): the tile side in pixels, the
    # norm kind ("layer_norm" / "rms_norm") and its eps, RMSNorm over q and k, q/k/v bias
    image_size: int = 0
    norm_type: str = "layer_norm"
    norm_eps: float = 1e-6
    qk_norm: bool = False
    attention_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_visual_indexes)

    @property
    def embed_row_dim(self) -> int:
        """Width of one encoder output row: the main embedding, then one per DeepStack level."""
        return self.out_hidden_size * (1 + self.num_deepstack)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    # a family whose videos have boundary tokens of their own (`MediaTokens.video_start`)
    video_start_token_id: int = -1
    video_end_token_id: int = -1

    @property
    def family(self) -> Family:
        """The model family this config belongs to (runtime/families/)."""
        return get_family(self.arch)

    @property
    def timestamped_video(self) -> bool:
        """Every temporal patch of a video is its own timestamped run of placeholders in the
        prompt, with its own position grid (t = 1): the family decides."""
        return self.family.timestamped_video

    @classmethod
    def from_dir(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in {model_path}")
        config = cls.from_dict(json.loads(path.read_text()), added_tokens(model_path))
        more = _eos_ids(read_generation_config(model_path))
        eos = config.eos_token_ids + tuple(t for t in more if t not in config.eos_token_ids)
        return dataclasses.replace(config, eos_token_ids=eos)

    @classmethod
    def from_dict(cls, cfg: dict, tokens: Mapping[str, int] | None = None) -> ModelConfig:
        """`tokens`: the tokenizer's special token ids by string, for the media token ids a
        config.json leaves to the tokenizer (InternVL's names only its image token)."""
        family = family_for(cfg)
        text, vision = text_and_vision(cfg)
        token, keys = _token_ids(cfg, tokens or {}), family.tokens
        video = {} if not keys.video_start else {
            "video_start_token_id": token(keys.video_start_id_key, keys.video_start),
            "video_end_token_id": token(keys.video_end_id_key, keys.video_end),
        }  # fmt: skip
        return cls(
            arch=family.name,
            text=text,
            vision=vision,
            image_token_id=token(keys.image_id_key, keys.image_pad),
            video_token_id=token(keys.video_id_key, keys.video_pad) if keys.video_pad else -1,
            vision_start_token_id=token(keys.start_id_key, keys.start),
            vision_end_token_id=token(keys.end_id_key, keys.end),
            eos_token_ids=_eos_ids(cfg),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
            **video,
        )


def text_and_vision(cfg: dict) -> tuple[TextConfig, VisionConfig]:
    """The text and vision configs of a config.json, as its family reads them (no token ids:
    those may need the tokenizer)."""
    family = family_for(cfg)
    text = TextConfig(**family.text_fields(cfg.get("text_config") or cfg, cfg))
    vision = VisionConfig(**family.vision_fields(cfg["vision_config"], text.hidden_size, cfg))
    return text, vision


def _token_ids(cfg: dict, tokens: Mapping[str, int]) -> Callable[[str, str], int]:
    def get(name: str, token: str) -> int:
        value = cfg.get(name)
        if value is None and isinstance(cfg.get("text_config"), dict):
            value = cfg["text_config"].get(name)
        if value is None:
            value = tokens.get(token)
        if value is None:
            raise ModelConfigError(f"config.json lacks {name} and the tokenizer lacks {token}")
        return int(value)

    return get


def added_tokens(model_path: str | Path) -> dict[str, int]:
    """The special tokens tokenizer_config.json declares (`added_tokens_decoder`), by string;
    {} without the file."""
    path = Path(model_path) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    decoder = json.loads(path.read_text()).get("added_tokens_decoder") or {}
    return {entry["content"]: int(i) for i, entry in decoder.items()}


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None and isinstance(cfg.get("text_config"), dict):
        eos = cfg["text_config"].get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


# ---------------------------------------------------------------------- generation config

GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# transformers' own defaults: a generation_config.json value equal to one of these is no
# default of the checkpoint's (vLLM reads the file's difference from them the same way)
HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def read_generation_config(model_path: str | Path) -> dict:
    """generation_config.json of a checkpoint folder ({} when it has none)."""
    path = Path(model_path) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's sampling defaults for the fields a request leaves unset (`--generation-
    config auto`, as vLLM reads them), or none (`vllm`). Its EOS ids always join the stop set
    (`ModelConfig.eos_token_ids`), as in vLLM with either setting. The checkpoint's defaults
    come before tessera's own (invariant 16)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def load(cls, model_path: str | Path | None, mode: str = "auto") -> GenerationDefaults:
        if mode == "vllm" or model_path is None:
            return cls()
        raw = read_generation_config(model_path)
        values = {
            name: raw[name]
            for name in (*GENERATION_DEFAULT_FIELDS, "max_new_tokens")
            if raw.get(name) is not None and raw[name] != HF_GENERATION_DEFAULTS.get(name)
        }
        return cls(**values)

    def in_force(self) -> dict[str, float | int]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
