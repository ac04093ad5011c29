"""MRoPE positions for prompts that mix text, images and videos.

Every token gets three position ids (temporal, height, width):

- text: all three equal, counting up by one per token;
- an image or video item: a 3-D grid over its merged patches, offset by the position where the
  item starts: temporal = frame-patch index (or, when `tokens_per_second` is given, the index
  times `second_per_grid_t * tokens_per_second`, truncated), height/width = merged row/column;
- text after an item starts at the largest position used by that item plus one.

A decoded token at sequence index i has position i + delta on all three axes, where
delta = (largest prompt position + 1) - prompt length.

The span-based entry point does not look at token ids at all, so it works on prompts whose
placeholder runs were already replaced by per-item pad values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.multimodal import Modality, item_tokens


@dataclass(frozen=True)
class MRopeItem:
    """One image or video occupying the half-open token range [start, end) of the prompt."""

    start: int
    end: int
    modality: Modality
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None

    def num_tokens(self, spatial_merge_size: int) -> int:
        return item_tokens(self.grid_thw, spatial_merge_size)


def compute_mrope_positions_from_items(
    seq_len: int,
    items: Sequence[MRopeItem],
    *,
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions [3, seq_len] (long) and the decode delta for a prompt with the given items.

    `items` must be in prompt order and not overlap. `tokens_per_second` switches video temporal
    ids to time-scaled ids (Qwen2.5-VL); leave it None for frame-patch indices (Qwen2-VL).
    """
    chunks: list[torch.Tensor] = []
    cursor = next_pos = 0
    for item in items:
        _check_item(item, cursor, seq_len, spatial_merge_size)
        chunks.append(text_positions(item.start - cursor, next_pos))
        next_pos += item.start - cursor
        grid, extent = _item_grid(item, spatial_merge_size, tokens_per_second)
        chunks.append(grid + next_pos)
        next_pos, cursor = next_pos + extent, item.end
    chunks.append(text_positions(seq_len - cursor, next_pos))
    next_pos += seq_len - cursor
    return torch.cat(chunks, dim=1), next_pos - seq_len


def text_positions(length: int, start: int) -> torch.Tensor:
    """[3, length] positions start, start+1, ... repeated on the three axes."""
    return (torch.arange(length, dtype=torch.long) + start).expand(3, length)


def _item_grid(
    item: MRopeItem, merge: int, tokens_per_second: float | None
) -> tuple[torch.Tensor, int]:
    """An item's grid positions from 0, in its token order, and how far they reach (largest
    plus one): made once per shape, since a conversation resends the same images every turn
    (about 0.1 ms each to build)."""
    temporal = tuple(temporal_ids(item, tokens_per_second).tolist())
    return _grid(temporal, item.grid_thw[1] // merge, item.grid_thw[2] // merge)


@functools.lru_cache(maxsize=256)
def _grid(temporal: tuple[int, ...], rows: int, cols: int) -> tuple[torch.Tensor, int]:
    """[3, len(temporal)*rows*cols] (read-only: callers add to it, never in place)."""
    axes = torch.tensor(temporal, dtype=torch.long), torch.arange(rows), torch.arange(cols)
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(3, -1)
    return grid, int(grid.max()) + 1


def temporal_ids(item: MRopeItem, tokens_per_second: float | None) -> torch.Tensor:
    """Temporal ids of an item's frame patches (before the start offset)."""
    index = torch.arange(item.grid_thw[0], dtype=torch.long)
    if item.modality != Modality.VIDEO or tokens_per_second is None:
        return index
    seconds = 1.0 if item.second_per_grid_t is None else float(item.second_per_grid_t)
    # float32 arithmetic, truncated: the ids a model trained with time-scaled ids expects.
    scaled = index.to(torch.float32) * seconds * float(tokens_per_second)
    return scaled.long()


def _check_item(item: MRopeItem, cursor: int, seq_len: int, merge: int) -> None:
    if not cursor <= item.start < item.end <= seq_len:
        raise ValueError(
            f"item span [{item.start}, {item.end}) is out of order or outside [{cursor}, {seq_len})"
        )
    t, h, w = item.grid_thw
    if min(t, h, w) < 1 or h % merge or w % merge:
        raise ValueError(f"grid {item.grid_thw} does not fit spatial merge size {merge}")
    if item.end - item.start != item.num_tokens(merge):
        raise ValueError(
            f"item span [{item.start}, {item.end}) has {item.end - item.start} tokens, "
            f"grid {item.grid_thw} needs {item.num_tokens(merge)}"
        )


def decode_positions(seq_index: int | torch.Tensor, delta: int) -> torch.Tensor:
    """Positions [3, n] of decoded tokens at the given sequence indices."""
    index = torch.as_tensor(seq_index, dtype=torch.long).reshape(-1)
    return (index + delta).unsqueeze(0).repeat(3, 1)


def find_mrope_items(
    ids: Sequence[int],
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
    image_grid_thw: Sequence[tuple[int, int, int]],
    video_grid_thw: Sequence[tuple[int, int, int]],
    second_per_grid_ts: Sequence[float] | None = None,
) -> list[MRopeItem]:
    """Spans of the image/video placeholder runs in `ids`, paired with their grids in order."""
    kinds = {image_token_id: Modality.IMAGE, video_token_id: Modality.VIDEO}
    grids = {Modality.IMAGE: list(image_grid_thw), Modality.VIDEO: list(video_grid_thw)}
    used = {Modality.IMAGE: 0, Modality.VIDEO: 0}
    items: list[MRopeItem] = []
    for start in _item_starts(ids, vision_start_token_id, set(kinds)):
        modality = kinds[ids[start]]
        grid = _next_grid(grids[modality], used[modality], modality)
        seconds = _seconds_for(modality, used[Modality.VIDEO], second_per_grid_ts)
        used[modality] += 1
        end = _run_end(ids, start, grid, spatial_merge_size)
        items.append(MRopeItem(start, end, modality, grid, seconds))
    _check_all_used(grids, used)
    return items


def _item_starts(ids: Sequence[int], vision_start: int, kinds: set[int]) -> list[int]:
    return [i + 1 for i in range(len(ids) - 1) if ids[i] == vision_start and ids[i + 1] in kinds]


def _next_grid(
    grids: list[tuple[int, int, int]], index: int, modality: Modality
) -> tuple[int, int, int]:
    if index >= len(grids):
        raise ValueError(f"prompt has more {modality.value} items than {modality.value} grids")
    return grids[index]


def _seconds_for(
    modality: Modality, video_index: int, second_per_grid_ts: Sequence[float] | None
) -> float | None:
    if modality != Modality.VIDEO or second_per_grid_ts is None:
        return None
    if video_index >= len(second_per_grid_ts):
        raise ValueError("fewer second_per_grid_ts values than videos")
    return second_per_grid_ts[video_index]


def _run_end(ids: Sequence[int], start: int, grid: tuple[int, int, int], merge: int) -> int:
    end = start + item_tokens(grid, merge)
    if end > len(ids) or any(ids[i] != ids[start] for i in range(start, end)):
        raise ValueError(f"placeholder run at {start} is shorter than grid {grid}")
    return end


def _check_all_used(grids: dict[Modality, list], used: dict[Modality, int]) -> None:
    for modality, grid_list in grids.items():
        if used[modality] != len(grid_list):
            raise ValueError(
                f"{len(grid_list)} {modality.value} grids given, {used[modality]} found in prompt"
            )
