"""Multimodal data carried with a request from the TokenizerManager to every scheduler rank."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    `embedded`: the feature is already the item's embedding (all its rows, DeepStack levels
    included), encoded by an encoder server (`--encoder-urls`), not its pixels; `awaiting`: the
    request was sent before its encoder job ended, and its feature follows in an
    `ItemEmbeddings` message (the scheduler runs no chunk over the item until then).
    `model_specific_data` (the design's name) is a read-only view of these by HF's names
    (`image_grid_thw` / `video_grid_thw` as a [1, 3] tensor, `second_per_grid_t`), each also an
    attribute of the item; the grid itself is stored once, in `grid_thw`.
    """

    modality: Modality
    feature: torch.Tensor | None = None
    hash: int = 0
    pad_value: int = 0
    offsets: list[tuple[int, int]] = field(default_factory=list)
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    second_per_grid_t: float | None = None
    embedded: bool = False  # `feature` holds the item's embedding rows (an encoder server's)
    awaiting: bool = False  # no feature yet: an `ItemEmbeddings` message brings it later

    def set_pad_value(self) -> None:
        """From the item's digest: the same content, the same pad value on every rank, and
        radix keys that carry it (invariants 1 and 6)."""
        self.pad_value = MM_PAD_SHIFT_VALUE + self.hash % 2**PAD_VALUE_BITS

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the tokens from its first placeholder run to its last (a video's
        runs are separated by timestamp text)."""
        return min(s for s, _ in self.offsets), max(e for _, e in self.offsets)

    @property
    def model_specific_data(self) -> dict[str, Any]:
        key = f"{Modality(self.modality).value}_grid_thw"
        data: dict[str, Any] = {key: torch.tensor([self.grid_thw])}
        if self.second_per_grid_t is not None:
            data["second_per_grid_t"] = self.second_per_grid_t
        return data

    def __getattr__(self, name: str) -> Any:
        """HF's names for the item's data (`item.image_grid_thw`); only names the class lacks
        reach here, and never while the item is being unpickled (no fields yet)."""
        if name.endswith("_grid_thw") and "modality" in self.__dict__:
            data = self.model_specific_data
            if name in data:
                return data[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

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
