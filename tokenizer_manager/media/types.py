"""Value types the media front end and its worker processes share.

`MediaError` is the one error for everything a client's media can get wrong, wherever it is
found: in the fetch (URL policy, size, unreachable origin), in the header checks, or in the worker
that decodes it. The rest are plain picklable values: what a request names (`MediaRef`), what a
worker needs to preprocess it (`ProcessorSpec`, `MediaFile`) and what it sends back
(`ProcessedMedia`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.families import Family, family_for, get_family
from runtime.families.base import check_aspect_ratio
from runtime.multimodal import Modality
from runtime.transport.shm import SharedTensor
from tokenizer_manager.media.multimodal_inputs import PreparedMedia
from tokenizer_manager.media.video_processor import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VideoProcessingConfig,
    checkpoint_video_config,
    read_json,
)
from tokenizer_manager.protocol import APIError

if TYPE_CHECKING:
    from tokenizer_manager.media.load import MediaLimits

IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # HF's defaults for Qwen2-VL


class MediaError(APIError):
    """A client's media cannot be used: an `APIError` whose field defaults are the media's
    (param "messages", code "invalid_media"), so it reaches the HTTP reply as it is raised.

    Pickles across processes (CPU workers raise it too): every field has a default and the
    instance dict travels with the message.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = "messages",
        code: str | None = "invalid_media",
    ):
        super().__init__(message, status=status, param=param, code=code)


def media_param(modality: Modality) -> str:
    """The OpenAI request field that holds a media URL of this kind."""
    return "image_url" if modality == Modality.IMAGE else "video_url"


def too_large(max_bytes: int, param: str) -> MediaError:
    """A media item over its byte limit (encoded, or decoded from a compressed response)."""
    return MediaError(
        f"media item is too large: the limit is {max_bytes} bytes ({max_bytes / (1 << 20):.1f} "
        "MiB)",
        param=param,
        code="media_too_large",
    )


def bad_video(message: str, code: str = "invalid_video") -> MediaError:
    """The client's video cannot be used (param video_url)."""
    return MediaError(message, param="video_url", code=code)


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

    def image_cost(self, height: int, width: int) -> tuple[int, int]:
        """(tokens, decoded bytes bound) of an image of this size, from its header alone.

        Tokens follow the family's resize rule and token count; the bytes count the decoded RGBA
        image and the float32 patches (two temporal copies of each pixel).
        """
        image, family = self.image, self.model_family
        try:
            h, w = family.resize(height, width, self.factor, image.min_pixels, image.max_pixels)
        except ValueError as exc:
            raise MediaError(str(exc), param="image_url", code="invalid_media_size") from exc
        grid = (1, h // image.patch_size, w // image.patch_size)
        return family.item_tokens(grid, image.merge_size), height * width * 4 + h * w * 3 * 2 * 4

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
        image = VideoProcessingConfig.from_preprocessor_config({**defaults, **config})
        family = family_for(read_json(Path(model_path) / "config.json"))
        return cls(str(model_path), video, image, family.name)


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

