"""Multimodal data carried with a request from the TokenizerManager to every scheduler rank."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MM_PAD_SHIFT_VALUE = 1_000_000
# Bits of an item's hash its pad_value keeps: two different items share a prefix-cache key only
# if their 128-bit digests agree on these (SGLang keeps 30, which real traffic can hit by chance).
# The largest pad_value still fits an int64 input id; the embedding lookup never sees one.
PAD_VALUE_BITS = 62


class Modality(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


def item_tokens(grid_thw: tuple[int, int, int], spatial_merge_size: int) -> int:
    """Prompt tokens of one image or video with this patch grid: one per merged patch window.
    Every count of an item's tokens (placeholder expansion, header budgets, MRoPE spans) is
    this one."""
    t, h, w = grid_thw
    return t * h * w // spatial_merge_size**2


@dataclass
class MultimodalDataItem:
    """One image or video: its preprocessed patches and where its placeholder run sits.

    `offsets` lists half-open [start, end) token ranges of the placeholder run in the prompt;
    `grid_thw` is the item's patch grid, `second_per_grid_t` a video's seconds per temporal patch.
    """

    modality: Modality
    feature: torch.Tensor | None = None
    hash: int = 0
    pad_value: int = 0
    offsets: list[tuple[int, int]] = field(default_factory=list)
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid_t: float | None = None

    def set_pad_value(self) -> None:
        """From the item's digest: the same content, the same pad value on every rank, and
        radix keys that carry it (invariants 1 and 6)."""
        self.pad_value = MM_PAD_SHIFT_VALUE + self.hash % 2**PAD_VALUE_BITS

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.offsets)


# Encodes a batch's media items: embedding rows per item hash (the model's `encode_items`, or
# the scheduler's encoder cache in front of it).
ItemEncoder = Callable[[list[MultimodalDataItem]], dict[int, torch.Tensor]]


@dataclass
class MultimodalInputs:
    """All multimodal items of one request plus its MRoPE positions."""

    items: list[MultimodalDataItem]
    mrope_positions: torch.Tensor  # [3, prompt_len]
    mrope_position_delta: int = 0
