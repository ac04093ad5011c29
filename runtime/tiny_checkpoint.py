"""Write a random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL 3 checkpoint folder: the checkpoint
tessera's tests build and the one `launch.py` serves when no --model-path is given.

The folder looks like a published Instruct repository: the published config.json layout (flat for
Qwen2-VL / Qwen2.5-VL, nested `text_config` for Qwen3-VL), safetensors with the published tensor
names, a byte-level BPE tokenizer, the Instruct chat template, the image
processor settings and a generation config. Everything is deterministic: the same arguments give
byte-identical files.

The tiny preset is built so that tests can fail: weights are drawn with fan-in scaled standard
deviations (not the usual 0.02), so greedy outputs depend on the image and the prompt, and every
tensor, norms and biases included, is random, so a weight that is loaded wrongly changes the output.

Usage (scripts/make_tiny_checkpoint.py is the command-line wrapper of `main`):
    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --out /tmp/tiny-qwen2-vl
    python scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --out /data/q25-7b --preset 7b
    python scripts/make_tiny_checkpoint.py --arch qwen3_vl --out /tmp/tiny-qwen3-vl
    python scripts/make_tiny_checkpoint.py --arch internvl --out /tmp/tiny-internvl
    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --out /tmp/vit-heavy --preset vit-heavy
    python scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --out /tmp/vit-hd64 --preset vit-hd64
    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --out /tmp/hd64 --preset hd64

For Qwen3-VL the 7b preset has the shapes of Qwen3-VL-8B.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from runtime import families
from runtime.families import FAMILIES, Family, family_for, get_family
from runtime.families.tiny import is_small

# Every registered family with tiny presets, and every preset any of them has (each family
# declares its own: runtime/families/, `Family.tiny`).
ARCHS = tuple(FAMILIES)
PRESETS = tuple(dict.fromkeys(p for family in FAMILIES.values() for p in family.tiny.presets))
# Presets built in float32 from a transformers model in memory (`is_small`); 7b is streamed in
# bfloat16.
# vit-heavy (Qwen2-VL only) pairs a larger vision tower (depth 4, width 320, 4 heads of 80 as in
# the published towers, so it shards at tp 2 and 4) with the tiny text model: a prefill-bound
# checkpoint whose time goes to the vision tower, as with real checkpoints and large images, for
# benchmarks of the serving path and of the encoder modes on a CPU.
# hd64 (Qwen2-VL; InternVL and GLM-4.1V have their own, runtime/families/) has head_dim 64 in
# both towers (a 4-layer 512-wide decoder, a 4-layer 256-wide vision tower): the smallest shape
# every peer's CPU attention accepts, for side-by-side runs. 100m (Qwen2-VL only, about 100M
# parameters: 12 decoder layers of width 768, 8 vision blocks of width 512) is large enough
# that the model's arithmetic, not per-step overhead, dominates.
# vit-hd64 (Qwen2.5-VL only) is the encoder-heavy shape with head_dim 64 in the decoder, so a peer
# whose CPU attention needs it can run the ViT DP-vs-TP comparison: a 2-layer 256-wide decoder
# (4 heads of 64, 2 KV heads) behind a depth-6 vision tower of width 320 (4 heads of 80, windowed
# attention with full attention in blocks 2 and 5), so the time goes to the vision tower.

# Number of byte-level BPE tokens (256 byte symbols plus learned merges); the special tokens follow.
BPE_VOCAB_SIZE = 368
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The split rule the Qwen2 tokenizer applies before byte-level encoding.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """\
The little robot walked to the window and looked at the garden. The sun was bright, the grass
was green, and a red bird sat on the fence. It counted the flowers: one, two, three, four, five.
Then it turned around and told the children what it had seen outside.

A picture shows a cat sitting on a table next to a cup of tea. The cat is black with white paws.
Behind the table there is a shelf with books, a small lamp and a plant in a blue pot. The room
is quiet and the light comes from the left side of the image.

What is in this image? Describe the scene in one sentence. The answer should be short and clear.
If you are not sure, say that you do not know. Please look at the colors, the shapes and the
people, and tell me where each object is.

In the video, a man rides a bicycle along the river. At the start he is far away, then he comes
closer, waves his hand and stops near the bridge. Two dogs run after him. The water is calm and
the sky is grey, with clouds moving slowly from the east to the west.

Server logs say that the request arrived at 10:42, the model answered after 350 milliseconds,
and the cache held 2048 tokens. Each user message is turned into numbers, the numbers are sent
to the model, and the model writes the reply one token at a time until it reaches the end.

You are a helpful assistant. Answer the question about the photo, the chart or the document.
Read the text in the picture carefully, count the items, compare the sizes and explain your
reasoning in simple words that anyone can follow.
"""

# The Qwen2-VL-Instruct chat template: one <|image_pad|> / <|video_pad|> per image / video part.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MAX_SHARD_BYTES = 4 * 1024**3


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(extra: tuple[str, ...] = (), pieces: tuple[str, ...] = ()) -> Tokenizer:
    """Train the byte-level BPE on the built-in corpus and append the special tokens (the
    shared ones, then a family's `extra` ones), then a family's plain added `pieces`."""
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens")
    specials = (*SPECIAL_TOKENS, *extra)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens (the shared ones and any family's) by string."""
    return {t.content: i for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special}


def family_tokenizer(arch: str) -> Tokenizer:
    """The tiny tokenizer of family `arch`: the shared special tokens and its own."""
    tiny = get_family(arch).tiny
    return build_tokenizer(tuple(token for _, token in tiny.special_tokens), tiny.pieces)


def save_tokenizer(tok: Tokenizer, out: Path, family: Family | None = None) -> None:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json (with the chat
    template and named special tokens of `family`; Qwen2-VL's by default)."""
    family = family or get_family("qwen2_vl")
    tok.save(str(out / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    write_json(out / "vocab.json", model["vocab"], indent=None)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    named = dict(family.tiny.special_tokens)
    config = {**tokenizer_config(tok, chat_template(family)), **named}
    config |= {"bos_token": family.tiny.bos_token, "eos_token": family.tiny.eos_tokens[0]}
    write_json(out / "tokenizer_config.json", config)


def chat_template(family: Family) -> str:
    return family.tiny.chat_template or CHAT_TEMPLATE


def tokenizer_config(tok: Tokenizer, template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(special_ids(tok))[1:],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------- configs


def checkpoint_config(arch: str, preset: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """config.json in the layout the published checkpoints of family `arch` use."""
    return get_family(arch).tiny.config(preset, ids, dtype)



def generation_config(
    preset: str, ids: dict[str, int], eos_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
) -> dict[str, Any]:
    """Published sampling defaults for 7b; plain greedy for tiny so HF comparisons stay simple."""
    eos = [ids[token] for token in eos_tokens]
    base = {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"]}
    if is_small(preset):
        return {**base, "do_sample": False, "eos_token_id": eos}
    sampling = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.1}
    return {**base, **sampling, "eos_token_id": eos, "top_k": 1, "top_p": 0.001}


def hf_config(flat: dict[str, Any]) -> Any:
    """transformers' config object for a config.json dict (flat, or nested for Qwen3-VL)."""
    import transformers

    return getattr(transformers, family_for(flat).tiny.hf_config_class)(**flat)


def hf_model_class(arch: str) -> type:
    import transformers

    return getattr(transformers, get_family(arch).architectures[0])


# ----------------------------------------------------------------------------- weights


def published_name(name: str, arch: str) -> str:
    """Map transformers' in-memory parameter names to the published checkpoint names of family
    `arch` (`TinyCheckpoint.published_name`)."""
    return get_family(arch).tiny.published_name(name)


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed, so every tensor is independent of the order tensors are made in."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str) -> str:
    """One name per tensor whatever the layout, for the init rules below."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return name


def is_norm(name: str) -> bool:
    parts = name.split(".")
    norms = ("norm1", "norm2", "ln_q")
    return any(p.endswith("norm") or p.startswith("layernorm") or p in norms for p in parts)


# Gains on top of 1/sqrt(fan_in), tuned so that greedy outputs depend on the image and the prompt:
# sharper attention (q, k) lets a token pick out content, larger attention and MLP outputs outweigh
# the current token's own embedding (else the model repeats it), a larger lm_head widens the gaps
# between the top logits.
GAINS = {
    "q_proj": 2.5,
    "k_proj": 2.5,
    "attn.qkv": 2.0,
    "o_proj": 2.0,
    "down_proj": 2.0,
    "lm_head": 2.0,
}
EMBED_STD = 0.3
POS_EMBED_STD = 0.5  # Qwen3-VL's learned vision position table: large enough to matter
TIED_EMBED_STD = 0.375
# Output rows of the special tokens and of the unused vocabulary tail get this fraction of the
# usual std: still random (so a misloaded row shows in the logits), but never the greedy choice.
QUIET_ROW_SCALE = 0.1


def init_stats(name: str, shape: tuple[int, ...], tied: bool) -> tuple[float, float]:
    """(mean, std) for one published tensor name.

    Matrices get std gain/sqrt(fan_in), so activations stay of order one through the layers. Norm
    weights scatter around one and biases around zero, all random, so a missing or misplaced
    tensor shows in the output.
    """
    name = canonical_name(name)
    if is_norm(name):
        return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.1)
    if name.endswith(("pos_embed.weight", "position_embeddings")):
        return 0.0, POS_EMBED_STD
    if name.endswith("cls_token"):
        return 0.0, EMBED_STD
    if name.endswith("bias"):
        return 0.0, 0.1
    if name == "model.embed_tokens.weight":
        return 0.0, TIED_EMBED_STD if tied else EMBED_STD
    gain = next((g for key, g in GAINS.items() if f"{key}." in name), 1.0)
    return 0.0, gain / math.sqrt(math.prod(shape[1:]))


def is_output_matrix(name: str, tied: bool) -> bool:
    return canonical_name(name) == ("model.embed_tokens.weight" if tied else "lm_head.weight")


def random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, tied: bool,
    arch: str | None = None,
) -> torch.Tensor:
    """Seeded normal values for one published tensor, drawn in fp32 chunks, stored in `dtype`
    (by `init_stats`, or family `arch`'s own rule for it: `TinyCheckpoint.init`)."""
    own = get_family(arch).tiny.init(name, shape) if arch is not None else None
    mean, std = own or init_stats(name, shape, tied)
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    buffer = torch.empty(min(flat.numel(), 1 << 24), dtype=torch.float32)
    for start in range(0, flat.numel(), buffer.numel()):
        part = buffer[: min(buffer.numel(), flat.numel() - start)]
        flat[start : start + part.numel()].copy_(part.normal_(mean, std, generator=gen))
    if is_output_matrix(name, tied):
        out[BPE_VOCAB_SIZE:] *= QUIET_ROW_SCALE
    return out


def meta_model(arch: str, flat: dict[str, Any]) -> Any:
    """transformers' model on the meta device: names and shapes without memory or init time."""
    with torch.device("meta"):
        return hf_model_class(arch)(hf_config(flat))


def build_model(arch: str, flat: dict[str, Any], seed: int) -> Any:
    """transformers' model in float32 on the CPU, every parameter filled with `random_tensor`."""
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move the global RNG
        model = hf_model_class(arch)(hf_config(flat)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape, tied = tuple(param.shape), flat["tie_word_embeddings"]
            published = published_name(name, arch)
            param.copy_(random_tensor(published, shape, param.dtype, seed, tied, arch))
    return model


def published_state(model: Any, arch: str, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under the published names, sorted; no lm_head when it is tied."""
    named = {published_name(n, arch): p.detach() for n, p in model.named_parameters()}
    if tied:
        named.pop("lm_head.weight", None)
    return iter(sorted(named.items()))


def streamed_state(
    arch: str, flat: dict[str, Any], seed: int, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `published_state`, one tensor at a time: for checkpoints too large to hold twice."""
    shapes = {
        published_name(n, arch): tuple(p.shape)
        for n, p in meta_model(arch, flat).named_parameters()
    }
    if flat["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    for name, shape in sorted(shapes.items()):
        yield name, random_tensor(name, shape, dtype, seed, flat["tie_word_embeddings"], arch)


def save_weights(weights: Iterator[tuple[str, torch.Tensor]], out: Path, max_bytes: int) -> None:
    """Write model.safetensors, or numbered shards plus an index when the weights are large."""
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(write_shard(current, out, len(shards)))
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
        total += nbytes
    if not shards:
        save_file(current, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)
        return
    shards.append(write_shard(current, out, len(shards)))
    finish_shards(shards, out, total)


def write_shard(tensors: dict[str, torch.Tensor], out: Path, index: int) -> list[str]:
    save_file(tensors, str(out / f"shard-{index:05d}.tmp"), metadata={"format": "pt"})
    return list(tensors)


def finish_shards(shards: list[list[str]], out: Path, total_size: int) -> None:
    """Give the shards their final names (the count is known only now) and write the index."""
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i:05d}.tmp").rename(out / final)
        (out / final).chmod(0o644)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


# ----------------------------------------------------------------------------- folder


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def save_generation_config(out: Path, values: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    GenerationConfig(**values).save_pretrained(out)


def remove_old_weights(out: Path) -> None:
    """Drop weight files of an earlier run, so a rebuilt folder never mixes two layouts."""
    for path in out.glob("model*.safetensors*"):
        path.unlink()
    for path in out.glob("shard-*.tmp"):
        path.unlink()


def write_processor_configs(family: Family, preset: str, out: Path) -> None:
    """preprocessor_config.json, and video_preprocessor_config.json and processor_config.json
    for a family with them."""
    write_json(out / "preprocessor_config.json", family.tiny.preprocessor(preset))
    if family.tiny.video_preprocessor is not None:
        video = family.tiny.video_preprocessor(preset)
        write_json(out / "video_preprocessor_config.json", video)
    if family.tiny.processor is not None:
        write_json(out / "processor_config.json", family.tiny.processor(preset))


def supported(arch: str, preset: str) -> bool:
    registered = families.FAMILIES
    return arch in registered and preset in registered[arch].tiny.presets


def make_checkpoint(
    arch: str,
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    generation: dict[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint folder for `arch` and `preset` into `out` and return its path.

    `generation` overrides fields of generation_config.json (written by transformers'
    GenerationConfig, so it is what HF `generate` reads), e.g. sampling defaults or an EOS list.

    The small presets are stored in float32, the 7b preset in bfloat16 (shards of at most 4 GiB).
    """
    if not supported(arch, preset):
        raise ValueError(f"unknown arch/preset {arch!r}/{preset!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    family = get_family(arch)
    tok = family_tokenizer(arch)
    ids = special_ids(tok)
    dtype = torch.float32 if is_small(preset) else torch.bfloat16
    flat = checkpoint_config(arch, preset, ids, str(dtype).removeprefix("torch."))
    remove_old_weights(out)
    save_tokenizer(tok, out, family)
    write_json(out / "config.json", flat)
    write_json(out / "chat_template.json", {"chat_template": chat_template(family)})
    write_processor_configs(family, preset, out)
    defaults = generation_config(preset, ids, family.tiny.eos_tokens)
    save_generation_config(out, {**defaults, **(generation or {})})
    if is_small(preset):
        model = build_model(arch, flat, seed)
        weights = published_state(model, arch, flat["tie_word_embeddings"])
    else:
        weights = streamed_state(arch, flat, seed, dtype)
    save_weights(weights, out, MAX_SHARD_BYTES)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generation",
        type=json.loads,
        default=None,
        help="JSON overriding generation_config.json fields (sampling defaults, eos_token_id)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    """Parse the command line, write the checkpoint, and say what was written (one line)."""
    args = parse_args(argv)
    start = time.perf_counter()
    out = make_checkpoint(args.arch, args.out, args.preset, args.seed, args.generation)
    elapsed = time.perf_counter() - start
    return f"wrote {args.arch} {args.preset} checkpoint to {out} in {elapsed:.1f} s"
