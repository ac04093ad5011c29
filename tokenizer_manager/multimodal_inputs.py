"""Turn a tokenized prompt plus preprocessed media into what the scheduler ranks receive.

Each image or video becomes one `MultimodalDataItem` whose hash is a SHA-256 digest of its
encoded bytes and the processor settings that change its features (computed once, by the media
worker that decoded it; never per rank). Its placeholder run in the prompt is replaced by the
item's pad_value, so prefix-cache keys differ whenever the media differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from runtime.model_config import ModelConfig
from runtime.mrope import MRopeItem, compute_mrope_positions_from_items, find_mrope_items
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs


@dataclass
class PreparedMedia:
    """One preprocessed image or video, in prompt order."""

    modality: Modality
    pixel_values: torch.Tensor  # [t*h*w patches, patch_dim]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    digest: int | None = None  # from the encoded bytes (mm_processor.media_digest), when known


def content_hash(media: PreparedMedia) -> int:
    """The item's hash: the media worker's digest of the encoded bytes and processor settings,
    or, for media prepared from pixels directly, a digest of the pixels and grid."""
    if media.digest is not None:
        return media.digest
    digest = hashlib.sha256()
    digest.update(media.modality.value.encode())
    digest.update(np.asarray(media.grid_thw, dtype=np.int64).tobytes())
    digest.update(media.pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes())
    if media.second_per_grid_t is not None:
        digest.update(repr(float(media.second_per_grid_t)).encode())
    return int.from_bytes(digest.digest()[:8], "little")


def _grid_key(modality: Modality) -> str:
    return "image_grid_thw" if modality == Modality.IMAGE else "video_grid_thw"


def make_item(media: PreparedMedia, span: MRopeItem) -> MultimodalDataItem:
    data: dict[str, object] = {_grid_key(media.modality): torch.tensor([media.grid_thw])}
    if media.second_per_grid_t is not None:
        data["second_per_grid_t"] = media.second_per_grid_t
    item = MultimodalDataItem(
        modality=media.modality,
        feature=media.pixel_values,
        hash=content_hash(media),
        offsets=[(span.start, span.end)],
        model_specific_data=data,
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
    spans = find_mrope_items(
        input_ids,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        spatial_merge_size=config.vision.spatial_merge_size,
        image_grid_thw=[x.grid_thw for x in by_kind[Modality.IMAGE]],
        video_grid_thw=[x.grid_thw for x in by_kind[Modality.VIDEO]],
        second_per_grid_ts=[x.second_per_grid_t or 1.0 for x in by_kind[Modality.VIDEO]],
    )
    queues = {m: iter(by_kind[m]) for m in Modality}
    items = [make_item(next(queues[span.modality]), span) for span in spans]
    ids = list(input_ids)
    for item in items:
        for start, end in item.offsets:
            ids[start:end] = [item.pad_value] * (end - start)
    return ids, MultimodalInputs(items, *_positions(len(ids), spans, config))


def _positions(seq_len: int, spans: list[MRopeItem], config: ModelConfig):
    tps = config.vision.tokens_per_second if config.arch == "qwen2_5_vl" else None
    return compute_mrope_positions_from_items(
        seq_len, spans, spatial_merge_size=config.vision.spatial_merge_size, tokens_per_second=tps
    )
