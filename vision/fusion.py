"""Fuse text and vision embeddings for one extend (prefill chunk) batch.

Prompts carry each image's pad_value at its placeholder positions. The text embedding of those
positions is replaced by the matching rows of the item's vision embedding; a chunk that cuts an
image takes only the rows that fall inside the chunk.

With DeepStack (Qwen3-VL) an encoder row is `[main | level 0 | level 1 | ...]`: the same row
slicing hands the chunk every level's matching rows, and the levels come back as one
[tokens, levels, hidden] tensor, zero at text positions, for the decoder to add.
"""

from __future__ import annotations

import torch

from runtime.forward_batch import ForwardBatch
from runtime.multimodal import ItemEncoder, MultimodalDataItem


def overlaps(item: MultimodalDataItem, chunk_start: int, chunk_end: int) -> bool:
    return any(s < chunk_end and e > chunk_start for s, e in item.offsets)


def items_in_batch(batch: ForwardBatch) -> list[MultimodalDataItem]:
    """Items that overlap any request's current chunk, deduplicated by hash, in batch order."""
    seen: dict[int, MultimodalDataItem] = {}
    for i, mm in enumerate(batch.mm_inputs or []):
        if mm is None:
            continue
        start = batch.prefix_lens_list[i]
        end = start + batch.extend_lens_list[i]
        for item in mm.items:
            if item.hash not in seen and overlaps(item, start, end):
                seen[item.hash] = item
    return list(seen.values())


def scatter_item_rows(
    embeds: torch.Tensor,
    item: MultimodalDataItem,
    item_embeds: torch.Tensor,
    chunk_start: int,
    chunk_end: int,
    token_base: int,
) -> None:
    """Write the rows of `item_embeds` that fall in [chunk_start, chunk_end) into `embeds`."""
    row = 0
    for s, e in item.offsets:
        lo, hi = max(s, chunk_start), min(e, chunk_end)
        if lo < hi:
            src = item_embeds[row + lo - s : row + hi - s]
            embeds[token_base + lo - chunk_start : token_base + hi - chunk_start] = src
        row += e - s


def fuse_embeddings(
    batch: ForwardBatch,
    text_embeds: torch.Tensor,
    encode: ItemEncoder,
    deepstack_levels: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input embeddings with every overlapping item's rows in place, DeepStack levels
    [tokens, levels, hidden] or None when the model has none or the batch holds no item).
    A chunk may cut an item: it takes the item's rows its tokens cover (invariant 5)."""
    items = items_in_batch(batch)
    if not items:
        return text_embeds, None
    by_hash = encode(items)
    tokens, hidden = text_embeds.shape
    embeds = text_embeds.new_zeros(tokens, hidden * (1 + deepstack_levels))
    embeds[:, :hidden] = text_embeds
    _scatter_batch(batch, embeds, by_hash)
    if deepstack_levels == 0:
        return embeds, None
    return embeds[:, :hidden], embeds[:, hidden:].view(tokens, deepstack_levels, hidden)


def _scatter_batch(
    batch: ForwardBatch, embeds: torch.Tensor, by_hash: dict[int, torch.Tensor]
) -> None:
    base = 0
    for i, mm in enumerate(batch.mm_inputs):
        start, length = batch.prefix_lens_list[i], batch.extend_lens_list[i]
        for item in mm.items if mm is not None else []:
            if overlaps(item, start, start + length):
                rows = by_hash[item.hash].to(embeds.dtype)
                scatter_item_rows(embeds, item, rows, start, start + length, base)
        base += length
