"""The tiny checkpoint script: folder layout, HF loading, tokenizer, determinism, sensitivity.

HF transformers is the oracle: it must load the folder as it loads a published Qwen2-VL /
Qwen2.5-VL checkpoint, and its greedy outputs must depend on the image and on the prompt.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import runtime.tiny_checkpoint as mtc
from runtime.families import FAMILIES, get_family, qwen2_vl
from runtime.model_config import ModelConfig
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.types import ProcessorSpec

ARCHS = ("qwen2_vl", "qwen2_5_vl")


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: mtc.make_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(folders: dict[str, Path]) -> dict[str, tuple[Any, dict[str, Any]]]:
    return {
        arch: mtc.hf_model_class(arch).from_pretrained(folder, output_loading_info=True)
        for arch, folder in folders.items()
    }


@pytest.fixture(scope="module")
def processors(folders: dict[str, Path]) -> tuple[Any, Any, str]:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = folders["qwen2_vl"]
    template = read_json(folder / "chat_template.json")["chat_template"]
    return (
        AutoTokenizer.from_pretrained(folder),
        AutoImageProcessor.from_pretrained(folder),
        template,
    )


# ----------------------------------------------------------------------------- HF inputs


def noise_image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))


def gradient_image() -> Image.Image:
    pixels = np.zeros((84, 112, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, 112, dtype=np.uint8)[None, :]
    pixels[..., 1] = np.linspace(0, 255, 84, dtype=np.uint8)[:, None]
    return Image.fromarray(pixels)


def hf_inputs(
    processors: tuple[Any, Any, str], text: str, image: Image.Image | None = None
) -> dict[str, torch.Tensor]:
    """Chat-template the message, expand the image placeholder, and build HF generate inputs."""
    tok, image_processor, template = processors
    parts: list[dict[str, str]] = [{"type": "image"}] if image is not None else []
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    extra: dict[str, torch.Tensor] = {}
    if image is not None:
        extra = dict(image_processor(images=[image], return_tensors="pt"))
        n_tokens = int(extra["image_grid_thw"][0].prod()) // 4
        prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    input_ids = tok(prompt, return_tensors="pt")["input_ids"]
    if image is not None:
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        extra["mm_token_type_ids"] = (input_ids == image_id).long()
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **extra}


def greedy(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
    """16 greedy tokens and the top-1 minus top-2 logit gap at each step."""
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=16,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    assert all(torch.isfinite(s).all() for s in out.scores)
    return tokens, gaps


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_flat_published_layout(folders: dict[str, Path], arch: str) -> None:
    config = read_json(folders[arch] / "config.json")
    assert "text_config" not in config
    assert config["model_type"] == arch
    assert config["architectures"] == list(get_family(arch).architectures)
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    text_shape = (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    assert text_shape == (64, 2, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is (arch == "qwen2_5_vl")
    assert config["vision_config"]["in_chans"] == 3
    assert config["torch_dtype"] == "float32"
    names = ("preprocessor_config.json", "generation_config.json", "tokenizer.json")
    assert all((folders[arch] / n).is_file() for n in names)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_are_the_published_ones(
    folders: dict[str, Path], loaded: dict[str, Any], arch: str, tmp_path: Path
) -> None:
    from safetensors import safe_open

    with safe_open(str(folders[arch] / "model.safetensors"), "pt") as f:
        ours = set(f.keys())
    assert not any("language_model" in n or n.startswith("model.visual") for n in ours)
    assert ("lm_head.weight" in ours) is (arch == "qwen2_vl")
    assert "visual.patch_embed.proj.weight" in ours and "model.norm.weight" in ours
    model, _ = loaded[arch]
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == ours


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_without_missing_keys_and_matches(
    folders: dict[str, Path], loaded: dict[str, Any], arch: str
) -> None:
    model, info = loaded[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    flat = read_json(folders[arch] / "config.json")
    reference = mtc.build_model(arch, flat, seed=0)
    input_ids = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        got, want = model(input_ids=input_ids).logits, reference(input_ids=input_ids).logits
    # bit-equal weights through the same modules on the same inputs: exact by construction
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tokenizer_and_token_ids(
    folders: dict[str, Path], processors: tuple[Any, Any, str]
) -> None:
    from tokenizers import Tokenizer

    tok = processors[0]
    raw = Tokenizer.from_file(str(folders["qwen2_vl"] / "tokenizer.json"))
    assert len(tok) == mtc.BPE_VOCAB_SIZE + len(mtc.SPECIAL_TOKENS) == raw.get_vocab_size()
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "Hello, world! <|im_start|>user\nWhat is 42 in the <|image_pad|> picture?<|im_end|>"
    assert tok(text)["input_ids"] == raw.encode(text).ids
    assert tok.decode(raw.encode(text).ids) == text
    for arch in ARCHS:
        config = read_json(folders[arch] / "config.json")
        assert config["vocab_size"] > len(tok)
        for key, token in [
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
            ("eos_token_id", "<|im_end|>"),
            ("bos_token_id", "<|endoftext|>"),
        ]:
            assert config[key] == tok.convert_tokens_to_ids(token), key
        generation = read_json(folders[arch] / "generation_config.json")
        assert generation["eos_token_id"] == [tok.eos_token_id, tok.pad_token_id]


def test_image_processor_settings(processors: tuple[Any, Any, str]) -> None:
    image_processor = processors[1]
    assert image_processor.size["shortest_edge"] == 3136
    assert image_processor.size["longest_edge"] == 200704
    assert (image_processor.patch_size, image_processor.merge_size) == (14, 2)
    out = image_processor(images=[noise_image(), gradient_image()], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    assert tuple(out["pixel_values"].shape) == (16 + 48, 3 * 2 * 14 * 14)


def test_chat_template_renders_vision_tokens(processors: tuple[Any, Any, str]) -> None:
    tok, _, template = processors
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is it?"}]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": content}],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "What is it?<|im_end|>\n<|im_start|>assistant\n"
    )


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_depends_on_image_and_prompt(
    loaded: dict[str, Any], processors: tuple[Any, Any, str], arch: str
) -> None:
    model, _ = loaded[arch]
    question = "What is in this image?"
    runs = [
        greedy(model, hf_inputs(processors, question, noise_image())),
        greedy(model, hf_inputs(processors, question, gradient_image())),
        greedy(model, hf_inputs(processors, "Describe the cat.")),
        greedy(model, hf_inputs(processors, "Where is the bicycle?")),
    ]
    tokens = [t for t, _ in runs]
    assert tokens[0] != tokens[1], "two different images gave the same greedy output"
    assert tokens[2] != tokens[3], "two different prompts gave the same greedy output"
    assert all(len(t) == 16 and max(t) < mtc.BPE_VOCAB_SIZE for t in tokens)
    assert all(len(set(t)) >= 4 for t in tokens), "degenerate (repeating) continuation"
    assert min(min(gaps) for _, gaps in runs) > 1e-4


# ----------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = file_hashes(mtc.make_checkpoint("qwen2_vl", tmp_path / "a", seed=0))
    again = file_hashes(mtc.make_checkpoint("qwen2_vl", tmp_path / "b", seed=0))
    other = file_hashes(mtc.make_checkpoint("qwen2_vl", tmp_path / "c", seed=1))
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_sharded_path_matches(
    folders: dict[str, Path], loaded: dict[str, Any], arch: str, tmp_path: Path
) -> None:
    """The 7b code path (meta model, tensors one by one, shards + index) on the tiny shapes."""
    flat = read_json(folders[arch] / "config.json")
    streamed = dict(mtc.streamed_state(arch, flat, 0, torch.float32))
    model = mtc.build_model(arch, flat, 0)
    built = dict(mtc.published_state(model, arch, flat["tie_word_embeddings"]))
    assert streamed.keys() == built.keys()
    assert all(torch.equal(streamed[n], built[n]) for n in built)
    for name in ("config.json", "preprocessor_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((folders[arch] / name).read_bytes())
    mtc.save_weights(iter(streamed.items()), tmp_path, max_bytes=200_000)
    index = read_json(tmp_path / "model.safetensors.index.json")
    assert len(set(index["weight_map"].values())) > 1 and index["weight_map"].keys() == built.keys()
    model, info = mtc.hf_model_class(arch).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    input_ids = torch.arange(5, 30).unsqueeze(0)
    with torch.no_grad():
        want = loaded[arch][0](input_ids=input_ids).logits
        # bit-equal weights (checked above) through the same modules: exact by construction
        torch.testing.assert_close(model(input_ids=input_ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_7b_preset_shapes(arch: str) -> None:
    tok = mtc.build_tokenizer()
    flat = mtc.checkpoint_config(arch, "7b", mtc.special_ids(tok), "bfloat16")
    params = dict(mtc.meta_model(arch, flat).named_parameters())
    total = sum(p.numel() for p in params.values())
    assert 8.2e9 < total < 8.4e9
    assert flat["rope_scaling"]["mrope_section"] == [16, 24, 24]
    assert not flat["tie_word_embeddings"] and "lm_head.weight" in params
    tensor = mtc.random_tensor("lm_head.weight", (1000, 64), torch.bfloat16, 0, tied=False)
    assert tensor.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS)
def test_7b_code_path_on_tiny_shapes(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make_checkpoint(preset="7b") end to end, with the shapes shrunk: bf16, shards, HF loads."""
    monkeypatch.setitem(qwen2_vl.TEXT_SHAPES, "7b", qwen2_vl.TEXT_SHAPES["tiny"])
    shapes = importlib.import_module(f"runtime.families.{arch}").VISION_SHAPES
    monkeypatch.setitem(shapes, "7b", shapes["tiny"])
    monkeypatch.setattr(mtc, "MAX_SHARD_BYTES", 100_000)
    folder = mtc.make_checkpoint(arch, tmp_path, preset="7b")
    config = read_json(folder / "config.json")
    assert config["torch_dtype"] == "bfloat16" and not config["tie_word_embeddings"]
    assert read_json(folder / "preprocessor_config.json")["max_pixels"] == 12845056
    assert not (folder / "model.safetensors").exists()
    model, info = mtc.hf_model_class(arch).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(input_ids=torch.arange(5, 30).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("preset", "low", "high"), [("hd64", 15e6, 25e6), ("100m", 95e6, 115e6)])
def test_peer_presets_have_head_dim_64(preset: str, low: float, high: float) -> None:
    """The side-by-side presets: head_dim 64 in both towers, and the advertised size."""
    ids = mtc.special_ids(mtc.build_tokenizer())
    flat = mtc.checkpoint_config("qwen2_vl", preset, ids, "float32")
    vision = flat["vision_config"]
    assert flat["hidden_size"] // flat["num_attention_heads"] == 64
    assert vision["embed_dim"] // vision["num_heads"] == 64
    assert sum(flat["rope_scaling"]["mrope_section"]) * 2 == 64
    total = sum(p.numel() for p in mtc.meta_model("qwen2_vl", flat).parameters())
    assert low < total < high


def test_encoder_heavy_peer_preset() -> None:
    """vit-hd64: head_dim 64 in the decoder (what a peer's CPU attention needs), 80 in the vision
    tower as published, and most of the weights in the vision tower."""
    flat = mtc.checkpoint_config(
        "qwen2_5_vl", "vit-hd64", mtc.special_ids(mtc.build_tokenizer()), "float32"
    )
    vision = flat["vision_config"]
    assert flat["hidden_size"] // flat["num_attention_heads"] == 64
    assert sum(flat["rope_scaling"]["mrope_section"]) * 2 == 64
    assert vision["hidden_size"] // vision["num_heads"] == 80
    assert vision["out_hidden_size"] == flat["hidden_size"]
    model = mtc.meta_model("qwen2_5_vl", flat)
    total = sum(p.numel() for p in model.parameters())
    visual = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert visual > 0.7 * total


@pytest.mark.parametrize("arch", ["internvl", "glm4v"])
def test_new_family_peer_presets_have_head_dim_64(arch: str) -> None:
    """hd64 of InternVL and GLM-4.1V: head_dim 64 in both towers (what a peer's CPU attention
    needs), a tower of several blocks as wide as the Qwen hd64 one, and a config tessera reads
    (InternVL: 224-pixel tiles of 64 tokens)."""
    ids = mtc.special_ids(mtc.family_tokenizer(arch))
    flat = mtc.checkpoint_config(arch, "hd64", ids, "float32")
    config = ModelConfig.from_dict(flat, ids)
    assert config.text.hidden_size // config.text.num_attention_heads == 64
    assert config.vision.embed_dim // config.vision.num_heads == 64
    assert config.vision.depth == 4 and config.vision.embed_dim == 256
    if arch == "internvl":  # a processor built from the folder alone reads the tile's tokens
        assert (config.vision.image_size, flat["image_seq_length"]) == (224, 64)
        assert get_family(arch).tiny.processor("hd64")["image_seq_length"] == 64
    total = sum(p.numel() for p in mtc.meta_model(arch, flat).parameters())
    assert 15e6 < total < 25e6


VIT_HEAVY = tuple(name for name, f in FAMILIES.items() if "vit-heavy" in f.tiny.presets)


def test_every_encoder_family_has_a_vit_heavy_preset() -> None:
    assert {"qwen2_vl", "internvl", "glm4v", "gemma3"} <= set(VIT_HEAVY)


@pytest.mark.parametrize("arch", VIT_HEAVY)
def test_vit_heavy_presets_spend_their_weights_in_the_tower(arch: str, tmp_path: Path) -> None:
    """The encoder modes' benchmark presets: a config tessera reads, heads of 64 to 80, most of
    the weights in the tower, and an 896x896 image of hundreds of patches or more (its
    resize, tiles or fixed size, as the family's processor makes it)."""
    ids = mtc.special_ids(mtc.family_tokenizer(arch))
    flat = mtc.checkpoint_config(arch, "vit-heavy", ids, "float32")
    vision = ModelConfig.from_dict(flat, ids).vision
    assert 64 <= vision.embed_dim // vision.num_heads <= 80 and vision.depth >= 4
    model = mtc.meta_model(arch, flat)
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for n, p in model.named_parameters() if "vis" in n)
    assert tower > 0.6 * total
    (tmp_path / "config.json").write_text(json.dumps(flat))
    preprocessor = get_family(arch).tiny.preprocessor("vit-heavy")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    t, h, w = ProcessorSpec.from_checkpoint(str(tmp_path), MediaLimits()).image_grid(896, 896)
    assert 400 <= t * h * w <= 4096
