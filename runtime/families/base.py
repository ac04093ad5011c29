"""What one model family declares: everything tessera needs to know about a checkpoint that the
shared code must not decide itself (design invariant 19).

A family is a plain value: data and pure functions, no torch modules. Its classes (vision tower,
decoder, composite model) are named as "module:Class" strings and resolved where the model is
built, so this floor (runtime/) never imports the floors above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Fields = dict[str, Any]


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served by tessera."""


@dataclass(frozen=True)
class Family:
    """One model family's entry in the registry (runtime/families/__init__.py).

    name: the family's key, also the config.json `model_type` it answers to.
    architectures: the config.json `architectures` names it serves.
    text_fields(text, top): `TextConfig` fields from the text part of config.json (`text_config`,
        or the whole config when flat) and the whole config.
    vision_fields(vision, text_hidden): `VisionConfig` fields from `vision_config`.
    tower_class / decoder_class / model_class: "module:Class" of its vision tower (floor 3,
        vision/), its decoder (floor 2, runtime/models/) and the composite that joins them
        (vision/vlm.py's by default), resolved where the model is built.
    checkpoint_name(name): a checkpoint tensor's name in the composite's layout (`visual.*` for
        the tower, the decoder's own names for the rest), from every layout the family's
        checkpoints are published in.
    timestamped_video: every temporal patch of a video is its own `<t seconds>`-stamped run of
        placeholders in the prompt, with its own position grid (t = 1).
    """

    name: str
    architectures: tuple[str, ...]
    text_fields: Callable[[dict, dict], Fields]
    vision_fields: Callable[[dict, int], Fields]
    tower_class: str
    decoder_class: str
    checkpoint_name: Callable[[str], str]
    model_class: str = "vision.vlm:VisionLanguageModel"
    timestamped_video: bool = False
