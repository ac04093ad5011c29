"""Turn a tokenized prompt plus preprocessed media into what the scheduler ranks receive.

Each image or video becomes one `MultimodalDataItem` whose hash is a 128-bit XXH3 digest of its
encoded bytes and the processor settings that change its features (computed once, by the media
worker that decoded it; never per rank). Its placeholder run in the prompt is replaced by the
item's pad_value, so prefix-cache keys differ whenever the media differ.

Prompt text per item is written here too (`expand_placeholders`), and the same expansion over
token ids (`expand_placeholder_ids`), so a prompt is tokenized once. The placeholder and
boundary tokens are the family's (`Family.tokens`, runtime/families/). A family with timestamped
videos stamps them (`Family.video_stamp`): the chat template's start + video pad + end (or the
pad alone, between video boundaries that stay) becomes, for every temporal patch, its stamp
around start + its placeholders + end (Qwen3-VL: `<{t:.1f} seconds>` before; GLM-4.1V: the
whole seconds after, with the image pad as placeholder). Such a video is still one item (one
encoding, one cache entry) with one offset range per temporal patch; each range is its own
position grid of one frame. Positions follow the family's position kind (`Family.positions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xxhash

from runtime.families.base import MediaTokens
from runtime.model_config import ModelConfig
from runtime.mrope import (
    MRopeItem,
    compute_mrope_positions_from_items,
    find_mrope_items,
    text_positions,
)
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.transport.shm import SharedTensor


def check_rendered_chat(prompt: str, media: list[Modality], tokens: MediaTokens) -> None:
    """A chat prompt as the template rendered it holds each processor token exactly as often as
    its media parts put it there; more means the client typed one (ValueError)."""
    runs = "".join(tokens.wrapped(m) for m in media)
    for token in tokens.processor_tokens:
        if prompt.count(token) != runs.count(token):
            raise ValueError(_typed(token))


def check_text_prompt(text: str, tokens: MediaTokens) -> None:
    """A text prompt may mark where its media go with placeholders (bare, or wrapped in
    start/end: `MediaTokens.wrapped`), but holds no start/end token of its own, a video's own
    boundaries included (ValueError)."""
    bare = text
    for modality in Modality:
        bare = bare.replace(tokens.wrapped(modality), "")
    video = (tokens.video_start, tokens.video_end) if tokens.video_start else ()
    for token in (tokens.start, tokens.end, *video):
        if token in bare:
            raise ValueError(_typed(token))


def with_placeholders(text: str, modalities: list[Modality], tokens: MediaTokens) -> str:
    """A text prompt with media but no placeholders gets one wrapped run per item in front."""
    if not modalities or tokens.mark_re.search(text):
        return text
    return "".join(tokens.wrapped(m) for m in modalities) + text


def check_prompt_ids(ids: list[int], config: ModelConfig) -> None:
    """Token-id prompts carry no media, so no processor token either (ValueError)."""
    tokens = config.family.tokens
    reserved = {
        config.image_token_id: tokens.image_pad,
        config.video_token_id: tokens.video_pad,
        config.vision_start_token_id: tokens.start,
        config.vision_end_token_id: tokens.end,
        config.video_start_token_id: tokens.video_start,
        config.video_end_token_id: tokens.video_end,
    }
    reserved.pop(-1, None)  # a family without video boundaries of their own
    found = next((token for token in ids if token in reserved), None)
    if found is not None:
        raise ValueError(f"token id {found} ({reserved[found]}) may only be placed by the server")


def _typed(token: str) -> str:
    return (
        f"{token} may only be placed by the server's media processor: send images and videos "
        "as content parts, not as special tokens in the text"
    )


@dataclass
class PreparedMedia:
    """One preprocessed image or video, in prompt order."""

    modality: Modality
    pixel_values: torch.Tensor | SharedTensor  # [t*h*w patches, patch_dim]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    digest: int | None = None  # from the encoded bytes (worker.media_digest), when known
    frame_times: tuple[float, ...] | None = None  # video: seconds of each temporal patch


def placeholder_text(media: PreparedMedia, config: ModelConfig) -> str:
    """The prompt text that stands for one item (its placeholder token repeated per token;
    per temporal patch with a timestamp for a family's timestamped videos)."""
    merge, count = config.vision.spatial_merge_size, config.family.item_tokens
    tokens, stamp = config.family.tokens, config.family.video_stamp
    runs = _run_count(media, config)
    if media.modality == Modality.IMAGE and runs > 1:  # each tile its own run
        t, h, w = media.grid_thw
        run = tokens.expanded(media.modality, count((1, h, w), merge))
        return _tile_text(config)(run, t)
    if media.modality != Modality.VIDEO or not config.timestamped_video:
        return tokens.expanded(media.modality, count(media.grid_thw, merge))
    t, h, w = media.grid_thw
    times = media.frame_times or tuple(float(i) for i in range(t))
    if len(times) != t:
        raise ValueError(f"video has {t} temporal patches and {len(times)} timestamps")
    frame = tokens.start + tokens.frame_pad * count((1, h, w), merge) + tokens.end
    return "".join(stamp.text(time, frame) for time in times)


def expand_placeholders(prompt: str, media: list[PreparedMedia], config: ModelConfig) -> str:
    """Replace the chat template's one placeholder per item by the item's prompt text.

    Raises ValueError when the placeholders do not match the media in number or kind."""
    tokens = config.family.tokens
    if config.timestamped_video and not config.family.video_stamp.keep_bounds:
        prompt = prompt.replace(tokens.wrapped(Modality.VIDEO), tokens.video_pad)
    pieces = tokens.pad_re.split(tokens.marked(prompt))
    if sum(p in tokens.pads for p in pieces) != len(media):
        raise ValueError(f"prompt has a media placeholder count other than {len(media)} items")
    queue = iter(media)
    out = []
    for piece in pieces:
        if piece in tokens.pads:
            item = next(queue)
            if piece != tokens.pad(item.modality):
                raise ValueError("media placeholders out of order")
            piece = placeholder_text(item, config)
        out.append(piece)
    return "".join(out)


def expand_placeholder_ids(
    ids: list[int], media: list[PreparedMedia], config: ModelConfig
) -> list[int] | None:
    """`ids` of the unexpanded prompt with each item's one placeholder token repeated to its
    token count (and wrapped in start/end where the template does not write them): the ids of
    `expand_placeholders`' text without tokenizing it again (the placeholders are special
    tokens, so the text around them tokenizes alike). None where only text can say it:
    timestamped videos, whose timestamps are text, and a family whose processor puts text
    around each item (`MediaTokens.surround`: it tokenizes together with its neighbours).
    A template mark that is the start token (Gemma 3's `<start_of_image>`) counts as a
    placeholder, so such a mark with no item to stand for is refused too.

    Raises ValueError when the placeholders do not match the media in number or kind."""
    if config.timestamped_video and any(m.modality == Modality.VIDEO for m in media):
        return None
    if config.family.tokens.surround and media:
        return None
    kinds = {config.image_token_id: Modality.IMAGE, config.video_token_id: Modality.VIDEO}
    if config.family.tokens.template_mark == config.family.tokens.start:  # Gemma 3's mark
        kinds[config.vision_start_token_id] = Modality.IMAGE
    found = [i for i, token in enumerate(ids) if token in kinds]
    if len(found) != len(media):
        raise ValueError(f"prompt has a media placeholder count other than {len(media)} items")
    out, start = [], 0
    merge = config.vision.spatial_merge_size
    wrap = [] if config.family.tokens.template_wraps else [config.vision_start_token_id]
    for at, item in zip(found, media):
        if kinds[ids[at]] != item.modality:
            raise ValueError("media placeholders out of order")
        out += ids[start:at] + wrap
        out += [ids[at]] * config.family.item_tokens(item.grid_thw, merge)
        out += [config.vision_end_token_id] if wrap else []
        start = at + 1
    return out + ids[start:]


def content_hash(media: PreparedMedia) -> int:
    """The item's hash: the media worker's digest of the encoded bytes and processor settings,
    or, for media prepared from pixels directly, a digest of the pixels and grid. Computed
    once, here in the front end, never per rank (invariant 1)."""
    if media.digest is not None:
        return media.digest
    digest = new_digest()
    digest.update(media.modality.value.encode())
    digest.update(np.asarray(media.grid_thw, dtype=np.int64).tobytes())
    digest.update(media.pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes())
    if media.second_per_grid_t is not None:
        digest.update(repr(float(media.second_per_grid_t)).encode())
    return digest_int(digest)


DIGEST_BYTES = 16  # an item's hash: 128 bits


class Hasher(Protocol):
    def update(self, data: bytes | memoryview) -> None: ...

    def digest(self) -> bytes: ...


def new_digest() -> Hasher:
    """The item hash function: XXH3-128, so a resent image is identified at memory speed (62
    against SHA-256's 1.8 GB/s on 4 MB on the 2-core CPU dev machine:
    `scripts/bench_multiturn.py --hash-only`)."""
    return xxhash.xxh3_128()


def digest_int(digest: Hasher) -> int:
    """An item hash from a hash object: its first DIGEST_BYTES bytes, little-endian."""
    return int.from_bytes(digest.digest()[:DIGEST_BYTES], "little")


def make_item(media: PreparedMedia, spans: list[MRopeItem]) -> MultimodalDataItem:
    item = MultimodalDataItem(
        modality=media.modality,
        feature=media.pixel_values,
        hash=content_hash(media),
        offsets=[(span.start, span.end) for span in spans],
        grid_thw=tuple(media.grid_thw),
        second_per_grid_t=media.second_per_grid_t,
    )
    item.set_pad_value()
    return item


def build_multimodal_inputs(
    input_ids: list[int], media: list[PreparedMedia], config: ModelConfig
) -> tuple[list[int], MultimodalInputs | None]:
    """Return (input ids with pad values, multimodal inputs); plain ids when there is no media."""
    if not media:
        return list(input_ids), None
    by_kind = {m: [x for x in media if x.modality == m] for m in Modality}
    runs = _video_runs(by_kind[Modality.VIDEO], config)
    spans = find_mrope_items(
        _frames_as_video(input_ids, config),
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        spatial_merge_size=config.vision.spatial_merge_size,
        image_grid_thw=[grid for x in by_kind[Modality.IMAGE] for grid in _run_grids(x, config)],
        video_grid_thw=[grid for grid, _ in runs],
        second_per_grid_ts=[seconds for _, seconds in runs],
    )
    items = [make_item(m, group) for m, group in _group_spans(spans, media, config)]
    ids = list(input_ids)
    for item in items:
        for start, end in item.offsets:
            ids[start:end] = [item.pad_value] * (end - start)
    return ids, MultimodalInputs(items, *_positions(len(ids), spans, config))


def _frames_as_video(ids: list[int], config: ModelConfig) -> list[int]:
    """`ids` with the frame pads between a family's own video boundaries (GLM-4.1V's frames
    repeat the image pad) read as video pads, so each run finds its item's kind."""
    tokens = config.family.tokens
    if not tokens.video_start or tokens.frame_pad == tokens.video_pad:
        return ids
    out, inside = list(ids), False
    for i, token in enumerate(ids):
        inside = (inside or token == config.video_start_token_id) and (
            token != config.video_end_token_id
        )
        if inside and token == config.image_token_id:
            out[i] = config.video_token_id
    return out


def _run_count(media: PreparedMedia, config: ModelConfig) -> int:
    """Placeholder runs of an item: one per temporal patch of a timestamped video, one per tile
    of an image where each tile is a run of its own (`Tiling.tile_text`), else one."""
    if media.modality == Modality.VIDEO:
        return media.grid_thw[0] if config.timestamped_video else 1
    tiling = config.family.tiling
    return media.grid_thw[0] if tiling is not None and tiling.tile_text is not None else 1


def _tile_text(config: ModelConfig) -> Callable[[str, int], str]:
    tiling = config.family.tiling
    assert tiling is not None and tiling.tile_text is not None
    return tiling.tile_text


def _run_grids(image: PreparedMedia, config: ModelConfig) -> list[tuple[int, int, int]]:
    """The grid of each placeholder run of an image (one per tile where tiles are runs)."""
    t, h, w = image.grid_thw
    runs = _run_count(image, config)
    return [(t // runs, h, w)] * runs


def _video_runs(
    videos: list[PreparedMedia], config: ModelConfig
) -> list[tuple[tuple[int, int, int], float]]:
    """(MRoPE grid, seconds per temporal patch) of every video placeholder run, in order."""
    out = []
    for video in videos:
        t, h, w = video.grid_thw
        count = _run_count(video, config)
        out += [((t // count, h, w), video.second_per_grid_t or 1.0)] * count
    return out


def _group_spans(
    spans: list[MRopeItem], media: list[PreparedMedia], config: ModelConfig
) -> list[tuple[PreparedMedia, list[MRopeItem]]]:
    """Pair every item with its placeholder runs (several for a timestamped video or an image
    whose tiles are runs)."""
    queues = {m: iter([x for x in media if x.modality == m]) for m in Modality}
    groups: list[tuple[PreparedMedia, list[MRopeItem]]] = []
    pending = iter(spans)
    for span in pending:
        item = next(queues[span.modality])
        count = _run_count(item, config)
        groups.append((item, [span, *(next(pending) for _ in range(count - 1))]))
    return groups


def _positions(
    seq_len: int, spans: list[MRopeItem], config: ModelConfig
) -> tuple[torch.Tensor, int]:
    """The prompt's positions [3, seq_len] and decode delta, by the family's position kind."""
    kind = config.family.positions
    if kind.kind == "1d":
        return text_positions(seq_len, 0), 0
    tps = config.vision.tokens_per_second if kind.time_scaled_video else None
    return compute_mrope_positions_from_items(
        seq_len, spans, spatial_merge_size=config.vision.spatial_merge_size, tokens_per_second=tps
    )
