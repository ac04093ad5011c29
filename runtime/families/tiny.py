"""What a family's tiny random checkpoints look like; runtime/tiny_checkpoint.py writes them
(tokenizer, weights, folder) for any family that declares a `TinyCheckpoint`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Presets streamed in bfloat16 (a family's large preset, shaped like a published checkpoint);
# every other preset a family declares is built in float32 from a transformers model in memory.
STREAMED_PRESETS = ("7b",)


def is_small(preset: str) -> bool:
    """Whether `preset` is built in float32 in memory (not streamed: `STREAMED_PRESETS`)."""
    return preset not in STREAMED_PRESETS


@dataclass(frozen=True)
class TinyCheckpoint:
    """A family's tiny-checkpoint presets.

    config(preset, ids, dtype): config.json in the family's published layout (`ids`: the
        tokenizer's special token ids by string).
    preprocessor(preset): preprocessor_config.json.
    hf_config_class: transformers' config class of the family (its model class is the family's
        first architecture).
    hf_processor_class: transformers' processor class that writes the family's placeholders,
        for a family whose expansion the shared (Qwen) one does not write (None: the shared
        one), with `hf_processor_keys`, the config.json keys it takes as settings of its own.
    published_name(name): transformers' in-memory parameter name -> the published tensor name.
    video_preprocessor(preset): video_preprocessor_config.json, for a family that has one.
    processor(preset): processor_config.json (the processor's own settings), for a family whose
        published checkpoints ship one.
    special_tokens: the family's own special tokens as (tokenizer_config.json key, token), added
        to the tiny tokenizer after the shared (Qwen) ones and named in its config by that key.
    chat_template: the family's chat template (None: the shared Qwen2-VL-Instruct one).
    pieces: plain (not special) added tokens its tokenizer holds as single pieces (Gemma's
        newline runs).
    init(name, shape): (mean, std) of a published tensor where the family's own computation
        wants other values than the shared rule's (None: the shared rule).
    eos_tokens / bos_token: its end-of-sequence tokens (generation_config.json, the tokenizer's
        eos) and its begin-of-sequence token (None: none).
    """

    presets: tuple[str, ...]
    config: Callable[[str, dict[str, int], str], dict[str, Any]]
    preprocessor: Callable[[str], dict[str, Any]]
    hf_config_class: str
    published_name: Callable[[str], str]
    video_preprocessor: Callable[[str], dict[str, Any]] | None = None
    processor: Callable[[str], dict[str, Any]] | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    chat_template: str | None = None
    pieces: tuple[str, ...] = ()
    init: Callable[[str, tuple[int, ...]], tuple[float, float] | None] = lambda name, shape: None
    eos_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    bos_token: str | None = None
    hf_processor_class: str | None = None
    hf_processor_keys: tuple[str, ...] = ()
