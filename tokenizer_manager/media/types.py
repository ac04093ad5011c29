"""Value types the media front end and its worker processes share: plain picklable values,
what a request names (`MediaRef`), what a worker needs to preprocess it (`ProcessorSpec`,
`MediaFile`) and what it sends back (`ProcessedMedia`). The error for a client's bad media
(`MediaError`) and the bounds (`MediaLimits`) are in media/limits.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.families import Family, family_for, get_family
from runtime.families.base import check_aspect_ratio
from runtime.model_config import text_and_vision
from runtime.multimodal import Modality
from runtime.transport.shm import SharedTensor
from tokenizer_manager.media.limits import MediaError, MediaLimits
from tokenizer_manager.media.multimodal_inputs import PreparedMedia
from tokenizer_manager.media.video_processor import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VideoProcessingConfig,
    checkpoint_video_config,
    clip_frames,
    read_json,
)

IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # HF's defaults for Qwen2-VL


def check_media_shape(height: int, width: int, param: str) -> None:
    """The aspect-ratio rule (`families.base.check_aspect_ratio`) as the client's error."""
    try:
        check_aspect_ratio(height, width)
    except ValueError as exc:
        message = f"media is {width}x{height}: {exc}"
        raise MediaError(message, param=param, code="invalid_media_size") from exc


@dataclass(frozen=True)
class MediaRef:
    """One image or video part of a request, in prompt order. `uuid` is the client's id for
    the item (a content part's `uuid`), within `scope` (the caller's tenant); with an id the
    processed-item cache already knows, `url` may be empty."""

    modality: Modality
    url: str
    uuid: str | None = None
    scope: str = ""


@dataclass(frozen=True)
class ProcessorSpec:
    """What a worker needs to preprocess media for one checkpoint (picklable)."""

    model_path: str
    video: VideoProcessingConfig
    image: VideoProcessingConfig  # the image geometry: patch, merge and pixel bounds
    family: str  # the checkpoint's model family: its resize rule and token count

    @property
    def factor(self) -> int:
        return self.image.patch_size * self.image.merge_size

    @property
    def model_family(self) -> Family:
        return get_family(self.family)

    def image_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid of an image of this size: (tiles, side, side) for a family that tiles
        (`Family.tiling`), else (1, h, w) of its resize rule's target size."""
        image, family = self.image, self.model_family
        if family.tiling is not None:
            bounds = (image.tile_size, image.min_tiles, image.max_tiles)
            side = image.tile_size // image.patch_size
            return family.tiling.count(height, width, *bounds), side, side
        try:
            h, w = family.resize(height, width, self.factor, image.min_pixels, image.max_pixels)
        except ValueError as exc:
            raise MediaError(str(exc), param="image_url", code="invalid_media_size") from exc
        return 1, h // image.patch_size, w // image.patch_size

    def video_size(self, height: int, width: int, frames: int) -> tuple[int, int]:
        """The (height, width) the frames of a clip of `frames` frames of this size are resized
        to: the family's resize rule within the video pixel bounds (per clip where the
        checkpoint's video processor budgets the clip, else per frame)."""
        cfg = self.video
        factor = cfg.patch_size * cfg.merge_size
        clip = clip_frames(frames, cfg.temporal_patch_size, cfg.clip_budget)
        return self.model_family.resize(height, width, factor, cfg.min_pixels, cfg.max_pixels,
                                        *clip)  # fmt: skip

    def video_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid of a clip of `frames` sampled frames of this size (the frame count
        padded to whole temporal patches)."""
        h, w = self.video_size(height, width, frames)
        patch, temporal = self.video.patch_size, self.video.temporal_patch_size
        return -(-frames // temporal), h // patch, w // patch

    def image_cost(self, height: int, width: int) -> tuple[int, int]:
        """(tokens, decoded bytes bound) of an image of this size, from its header alone.

        Tokens follow the family's resize or tiling rule and token count; the bytes count the
        decoded RGBA image and the float32 patches (two temporal copies of each pixel).
        """
        grid = self.image_grid(height, width)
        pixels = grid[0] * grid[1] * grid[2] * self.image.patch_size**2
        tokens = self.model_family.item_tokens(grid, self.image.merge_size)
        return tokens, height * width * 4 + pixels * 3 * 2 * 4

    def video_bytes_bound(self) -> int:
        """Decoded bytes a video may take at most: its sampled frames as float32, twice."""
        return self.video.max_frames * self.video.max_pixels * 3 * 4 * 2

    @classmethod
    def from_checkpoint(
        cls,
        model_path: str,
        limits: MediaLimits,
        *,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
    ) -> ProcessorSpec:
        """Patch, merge, mean and std from preprocessor_config.json (read once, here); video
        pixel bounds from the arguments (the image bounds in that file are for images only), or
        every video setting from a Qwen3-VL video_preprocessor_config.json; the frame cap from
        `limits`."""
        config = read_json(Path(model_path) / "preprocessor_config.json")
        video = checkpoint_video_config(
            model_path, config, min_pixels=video_min_pixels, max_pixels=video_max_pixels
        )
        video = dataclasses.replace(video, max_frames=min(video.max_frames, limits.max_frames))
        defaults = {} if "size" in config else {"min_pixels": IMAGE_MIN_PIXELS}
        defaults |= {} if "size" in config else {"max_pixels": IMAGE_MAX_PIXELS}
        # the merge window is the model's (a preprocessor_config.json may not name it)
        raw = read_json(Path(model_path) / "config.json")
        merge = {"merge_size": text_and_vision(raw)[1].spatial_merge_size}
        image = VideoProcessingConfig.from_preprocessor_config({**defaults, **config}, **merge)
        return cls(str(model_path), video, image, family_for(raw).name)


@dataclass(frozen=True)
class MediaFile:
    """An item's encoded bytes in a shared-memory file, for a worker to read: one write in the
    parent instead of pickling them through the worker's pipe (6.7 ms of the parent's CPU for
    a 4-image request, 2.3 MB, in 64 kB pipe writes)."""

    path: str

    def read(self) -> bytes:
        with open(self.path, "rb", buffering=0) as f:
            return f.read()


def input_bytes(data: bytes | MediaFile) -> bytes:
    return data.read() if isinstance(data, MediaFile) else data


@dataclass
class ProcessedMedia:
    """A worker's result: the pixels in a shared-memory file (a handle that pickles as its name),
    or, without shared memory, as numpy (plain bytes through the pipe)."""

    modality: Modality
    pixel_values: np.ndarray | SharedTensor  # float32 [t*h*w patches, patch_dim]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None
    digest: int | None = None  # media_digest of the encoded bytes and the processor settings
    frame_times: tuple[float, ...] | None = None  # video: seconds of each temporal patch

    def to_prepared(self) -> PreparedMedia:
        pixels = self.pixel_values
        if isinstance(pixels, np.ndarray):
            pixels = torch.from_numpy(pixels)
        return PreparedMedia(
            self.modality,
            pixels,
            self.grid_thw,
            self.second_per_grid_t,
            self.digest,
            self.frame_times,
        )
