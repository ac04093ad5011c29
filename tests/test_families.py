"""The model-family registry: each family registered once, found from either config layout,
an unknown architecture refused by name, and a new family picked up without shared code."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import runtime.families as families
from runtime.families import FAMILIES, family_for, get_family, register
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.multimodal import Modality
from runtime.tiny_checkpoint import build_tokenizer, checkpoint_config, special_ids

SHARED_MODULES = {"base", "tiny"}  # what every family builds on; each other module is a family
FAMILY_MODULES = sorted(
    m.name for m in pkgutil.iter_modules(families.__path__) if m.name not in SHARED_MODULES
)


@pytest.fixture(scope="module")
def ids() -> dict[str, int]:
    """Every family's special tokens: the shared ones, then each family's own."""
    extra = [token for family in FAMILIES.values() for _, token in family.tiny.special_tokens]
    return special_ids(build_tokenizer(tuple(extra)))


def config_of(name: str, ids: dict[str, int]) -> dict:
    return checkpoint_config(name, "tiny", ids, "float32")


def nested_layout(flat: dict) -> dict:
    """A flat config rewritten as transformers 5 writes it: text fields under text_config."""
    text_keys = {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_scaling",
                 "max_position_embeddings", "rope_theta"}  # fmt: skip
    nested = {k: v for k, v in flat.items() if k not in text_keys}
    nested["text_config"] = {k: flat[k] for k in text_keys if k in flat}
    return nested


def test_every_family_module_is_registered_once() -> None:
    declared = [importlib.import_module(f"runtime.families.{m}").FAMILY for m in FAMILY_MODULES]
    assert sorted(f.name for f in declared) == sorted(FAMILIES) == FAMILY_MODULES
    assert all(FAMILIES[f.name] is f for f in declared)
    architectures = [a for f in FAMILIES.values() for a in f.architectures]
    assert len(architectures) == len(set(architectures))


def test_a_name_or_architecture_is_registered_only_once() -> None:
    qwen = get_family("qwen2_vl")
    with pytest.raises(ValueError, match="registered already"):
        register(qwen)
    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration"):
        register(dataclasses.replace(qwen, name="another"))
    assert FAMILIES["qwen2_vl"] is qwen and "another" not in FAMILIES


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_finds_its_family_in_both_layouts(name: str, ids: dict[str, int]) -> None:
    published = config_of(name, ids)
    nested = published if "text_config" in published else nested_layout(published)
    for cfg in (published, nested):
        assert family_for(cfg) is FAMILIES[name]
        assert ModelConfig.from_dict(cfg, ids).arch == name
        by_type = {k: v for k, v in cfg.items() if k != "architectures"}
        assert family_for(by_type) is FAMILIES[name]
    assert ModelConfig.from_dict(nested, ids) == ModelConfig.from_dict(published, ids)


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ModelConfigError, match="unsupported architecture") as info:
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    for family in FAMILIES.values():
        for architecture in family.architectures:
            assert architecture in str(info.value)
    with pytest.raises(ModelConfigError, match="qwen2_vl"):
        get_family("llama")


def test_a_fourth_family_is_picked_up_by_config_parsing(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    seen: list[dict] = []

    def vision_fields(v: dict, text_hidden: int, top: dict) -> dict:
        seen.append(v)
        return get_family("qwen2_vl").vision_fields(v, text_hidden, top)

    config = with_fake_family(monkeypatch, ids, vision_fields=vision_fields, timestamped_video=True)
    assert config.arch == "fake_vl" and config.family is families.FAMILIES["fake_vl"]
    assert config.timestamped_video and seen == [config.raw["vision_config"]]
    assert "FakeVLForConditionalGeneration" in families.supported_architectures()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_classes_resolve_where_the_model_is_built(name: str) -> None:
    from torch import nn

    from vision.vlm import resolve_class

    family = FAMILIES[name]
    for path in (family.tower_class, family.decoder_class, family.model_class):
        assert issubclass(resolve_class(path), nn.Module), path


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoint_names_of_every_published_layout_meet(name: str) -> None:
    rename = FAMILIES[name].checkpoint_name
    pairs = {
        "model.language_model.layers.0.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight",
        "model.visual.blocks.0.attn.qkv.weight": "visual.blocks.0.attn.qkv.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for transformers_name, published in pairs.items():
        assert rename(transformers_name) == rename(published) == published


def with_fake_family(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int], **changes: object
) -> ModelConfig:
    """A config of a fake family registered for this test: Qwen2-VL's entry with `changes`."""
    monkeypatch.setattr(families, "FAMILIES", dict(FAMILIES))
    register(
        dataclasses.replace(
            get_family("qwen2_vl"),
            name="fake_vl",
            architectures=("FakeVLForConditionalGeneration",),
            **changes,
        )
    )
    cfg = {**config_of("qwen2_vl", ids), "architectures": ["FakeVLForConditionalGeneration"]}
    return ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_media_tokens_are_the_tokenizers_and_the_configs(name: str, ids: dict[str, int]) -> None:
    config = ModelConfig.from_dict(config_of(name, ids), ids)
    tokens = config.family.tokens
    assert ids[tokens.image_pad] == config.image_token_id
    if Modality.VIDEO in config.family.modalities:
        assert ids[tokens.video_pad] == config.video_token_id
    else:  # a family without videos may have no video token at all
        assert config.video_token_id == ids.get(tokens.video_pad, -1)
    assert ids[tokens.start] == config.vision_start_token_id
    assert ids[tokens.end] == config.vision_end_token_id


def test_shared_prompt_code_uses_the_familys_tokens(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    import torch

    from runtime.families.base import MediaTokens
    from runtime.multimodal import Modality
    from tokenizer_manager.media.multimodal_inputs import (
        PreparedMedia,
        check_rendered_chat,
        expand_placeholders,
    )

    tokens = MediaTokens(image_pad="<img>", video_pad="<vid>", start="<m>", end="</m>")
    config = with_fake_family(monkeypatch, ids, tokens=tokens)
    image = PreparedMedia(Modality.IMAGE, torch.zeros(0), (1, 4, 4))
    assert expand_placeholders("a<m><img></m>b", [image], config) == "a<m>" + "<img>" * 4 + "</m>b"
    assert expand_placeholders("a<|image_pad|>", [], config) == "a<|image_pad|>"
    check_rendered_chat("x<m><img></m>", [Modality.IMAGE], tokens)
    with pytest.raises(ValueError, match="</m> may only be placed"):
        check_rendered_chat("x<m><img></m></m>", [Modality.IMAGE], tokens)


def test_plain_positions_count_up_through_media(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    import torch

    from runtime.families.base import PositionKind
    from runtime.multimodal import Modality
    from tokenizer_manager.media.multimodal_inputs import PreparedMedia, build_multimodal_inputs

    config = with_fake_family(monkeypatch, ids, positions=PositionKind("1d"))
    image = PreparedMedia(Modality.IMAGE, torch.zeros(16, 8), (1, 4, 4))
    prompt = [7, config.vision_start_token_id, *[config.image_token_id] * 4, 9]
    _, mm = build_multimodal_inputs(prompt, [image], config)
    assert mm.mrope_positions.tolist() == [list(range(len(prompt)))] * 3
    assert mm.mrope_position_delta == 0
    with pytest.raises(ValueError, match="position kind"):
        PositionKind("2d")


def test_an_image_attention_rule_the_model_lacks_is_refused(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    from kernels.attention import create_attention_backend
    from runtime.distributed import TPGroup
    from vision.vlm import VisionLanguageModel

    class CausalOnly(VisionLanguageModel):
        IMAGE_ATTENTION = ("causal",)

    config = with_fake_family(monkeypatch, ids, image_attention="bidirectional_item")
    with pytest.raises(ModelConfigError, match="image attention 'bidirectional_item'"):
        CausalOnly(config, TPGroup(), create_attention_backend("torch"))
    # the composite itself computes both rules (the model runner gives it the item spans)
    VisionLanguageModel(config, TPGroup(), create_attention_backend("torch"))
    with pytest.raises(ValueError, match="image attention 'sideways'"):
        dataclasses.replace(get_family("qwen2_vl"), image_attention="sideways")
    with pytest.raises(ValueError, match="video sampling 'sideways'"):
        dataclasses.replace(get_family("qwen2_vl"), video_sampling="sideways")


def test_media_costs_follow_the_familys_resize_rule_and_token_count(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    import torch

    from runtime.multimodal import Modality
    from tokenizer_manager.media.multimodal_inputs import PreparedMedia, placeholder_text
    from tokenizer_manager.media.types import ProcessorSpec
    from tokenizer_manager.media.video_processor import VideoProcessingConfig

    asked: list[tuple[int, int]] = []

    def resize(height: int, width: int, *bounds: int) -> tuple[int, int]:
        asked.append((height, width))
        return 56, 84

    config = with_fake_family(monkeypatch, ids, resize=resize, item_tokens=lambda grid, m: 5)
    settings = VideoProcessingConfig()
    spec = ProcessorSpec("model", settings, settings, "fake_vl")
    assert spec.image_cost(100, 200) == (5, 100 * 200 * 4 + 56 * 84 * 3 * 2 * 4)
    assert asked == [(100, 200)]
    image = PreparedMedia(Modality.IMAGE, torch.zeros(0), (1, 4, 4))
    assert placeholder_text(image, config) == "<|image_pad|>" * 5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_processor_spec_knows_the_checkpoints_family(name: str, tmp_path, ids) -> None:
    import json

    from tokenizer_manager.media.limits import MediaLimits
    from tokenizer_manager.media.types import ProcessorSpec

    (tmp_path / "config.json").write_text(json.dumps(config_of(name, ids)))
    spec = ProcessorSpec.from_checkpoint(str(tmp_path), MediaLimits())
    assert spec.model_family is FAMILIES[name]


def test_tiny_checkpoints_follow_the_registry(
    monkeypatch: pytest.MonkeyPatch, ids: dict[str, int]
) -> None:
    import runtime.tiny_checkpoint as mtc
    from runtime.families.tiny import TinyCheckpoint

    assert set(mtc.ARCHS) == set(FAMILIES)
    assert all("tiny" in family.tiny.presets for family in FAMILIES.values())
    base = get_family("qwen2_vl").tiny
    tiny = TinyCheckpoint(
        presets=("tiny",),
        config=lambda preset, ids, dtype: {**base.config(preset, ids, dtype), "model_type": "fake"},
        preprocessor=base.preprocessor,
        hf_config_class=base.hf_config_class,
        published_name=base.published_name,
    )
    with_fake_family(monkeypatch, ids, tiny=tiny)
    assert mtc.supported("fake_vl", "tiny") and not mtc.supported("fake_vl", "7b")
    assert mtc.checkpoint_config("fake_vl", "tiny", ids, "float32")["model_type"] == "fake"


# The floors' own code (runtime/, scheduler/, tokenizer_manager/, vision/, kernels/), less each
# family's own modules (runtime/families/, and the tower, decoder and composite it names) and
# the tiny-checkpoint writer (its shared tokenizer and default are Qwen2-VL's; each family's
# presets are its own module's `TinyCheckpoint`).
FLOORS = ("runtime", "scheduler", "tokenizer_manager", "vision", "kernels")
NOT_SHARED = ("runtime/families/", "runtime/tiny_checkpoint.py")


def family_words() -> set[str]:
    """What names a family: its name, its architectures, its media tokens."""
    words = set()
    for family in FAMILIES.values():
        tokens = family.tokens
        words |= {family.name, *family.architectures, *tokens.processor_tokens}
        words.add(tokens.template_mark)
    return words - {""}


def code_names(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant (docstrings aside) and every name in `source`."""
    tree = ast.parse(source)
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    bodies = [n.body for n in ast.walk(tree) if isinstance(n, scopes)]
    docs = {id(b[0].value) for b in bodies if b and isinstance(b[0], ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name


def test_shared_code_names_no_family() -> None:
    """Design invariant 19: no string or name in shared code holds a family's name, one of its
    architectures or one of its media tokens; shared code asks the family (comments may cite
    one as an example)."""
    root = Path(__file__).resolve().parents[1]
    own = {c.split(":")[0].replace(".", "/") + ".py" for f in FAMILIES.values()
           for c in (f.tower_class, f.decoder_class, f.model_class)}  # fmt: skip
    words, found = family_words(), []
    for path in sorted(p for floor in FLOORS for p in (root / floor).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in own or name.startswith(NOT_SHARED):
            continue
        for line, text in code_names(path.read_text()):
            found += [f"{name}:{line} {word!r}" for word in words if word in text]
    assert not found, found
