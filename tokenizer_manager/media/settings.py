"""Per-request media settings (`mm_processor_kwargs`): checked against the server's limits and
applied to a copy of the server's `ProcessorSpec`.

The keys are the ones HF's Qwen2-VL processors take: `min_pixels` and `max_pixels` (images and
video frames), and for video `fps`, `num_frames` (a fixed count instead of `fps`, rounded as HF
rounds it; the frames are spread as tessera spreads them at `fps`), `min_frames` and
`max_frames` (GLM-4.1V's video processor samples by `fps` alone: the frame keys are refused
there); for a family that tiles images (InternVL's GotOcr2 processor) `min_patches`,
`max_patches` (tile counts, a thumbnail aside) and `crop_to_patches` (false: the image as one
tile), the pixel bounds being refused there; for Gemma 3 `do_pan_and_scan` (true: the whole
image and up to 4 crops of a long image, as its processor cuts them) and, with it,
`pan_and_scan_max_num_crops` (1 to 4: the most crops), every other tiling key refused there.
A request's spec is what its items are resized, sampled, digested and cached by:
`worker.media_digest` hashes the whole spec, so an item processed with one setting never serves
a request that asked for another (the processed-item cache, the encoder cache and the radix
cache all key on that digest)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from runtime.families.base import Tiling
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.protocol import APIError

PARAM = "mm_processor_kwargs"
PIXEL_KEYS = ("min_pixels", "max_pixels")
FRAME_KEYS = ("min_frames", "max_frames")
TILE_KEYS = ("min_patches", "max_patches", "crop_to_patches")
SWITCH_KEYS = ("do_pan_and_scan",)  # a family's cropping switch (`Tiling.switched_on`)
CROP_KEYS = ("pan_and_scan_max_num_crops",)  # the crops the switch makes at most (`crops_key`)
TILE_SET = frozenset((*TILE_KEYS, *SWITCH_KEYS, *CROP_KEYS))
KEYS = (*PIXEL_KEYS, *TILE_KEYS, *SWITCH_KEYS, *CROP_KEYS, "fps", "num_frames", *FRAME_KEYS)
MAX_FPS = 60.0


def _bad(key: str, message: str) -> APIError:
    return APIError(f"{PARAM}.{key}: {message}", param=f"{PARAM}.{key}", code="invalid_value")


def _integer(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _bad(key, f"must be in [{low}, {high}] on this server, got {value}")
    return value


def _fps(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad("fps", f"must be a number, got {value!r}")
    if not 0 < value <= MAX_FPS:
        raise _bad("fps", f"must be in (0, {MAX_FPS:g}] on this server, got {value}")
    return float(value)


def pixel_range(spec: ProcessorSpec) -> tuple[int, int]:
    """The pixel bounds a request may ask for: one merged patch up to the server's own largest
    bound (images' or videos')."""
    return spec.factor**2, max(spec.image.max_pixels, spec.video.max_pixels)


def checked_settings(raw: dict[str, Any] | None, spec: ProcessorSpec) -> dict[str, Any]:
    """The request's settings, each checked against this server's limits (APIError 400 naming
    `mm_processor_kwargs.<key>` otherwise; unknown keys are refused by name)."""
    if not raw:
        return {}
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        message = f"unknown key(s) {', '.join(unknown)}; supported: {', '.join(KEYS)}"
        raise APIError(f"{PARAM}: {message}", param=f"{PARAM}.{unknown[0]}", code="invalid_value")
    settings = _tile_settings(raw, spec)
    frames = (*FRAME_KEYS, "num_frames")
    by_fps = next((k for k in frames if k in raw and spec.video.sampling != "uniform"), None)
    if by_fps is not None:
        raise _bad(by_fps, f"{spec.family} checkpoints sample video frames by fps alone")
    low, high = pixel_range(spec)
    settings |= {k: _integer(k, raw[k], low, high) for k in PIXEL_KEYS if k in raw}
    settings |= {k: _integer(k, raw[k], 1, spec.video.max_frames) for k in frames if k in raw}
    if "fps" in raw and "num_frames" in raw:
        raise _bad("num_frames", "fps and num_frames are mutually exclusive")
    if "fps" in raw:
        settings["fps"] = _fps(raw["fps"])
    _check_order(settings, "min_pixels", "max_pixels")
    _check_order(settings, "min_frames", "max_frames")
    return settings


def _tile_settings(raw: dict[str, Any], spec: ProcessorSpec) -> dict[str, Any]:
    """The tiling keys of a tiling family, the ones its processor takes (`Tiling.keys`; any
    other tiling key, and the pixel bounds, refused by name, as the tiling keys are for a
    family that resizes): tile counts up to the server's own most, switches true or false."""
    tiling = spec.model_family.tiling
    allowed = tiling.keys if tiling is not None else ()
    other = (*PIXEL_KEYS, *TILE_SET) if tiling else tuple(TILE_SET)
    wrong = next((k for k in other if k in raw and k not in allowed), None)
    if wrong is not None:
        kind = "tile images; pixel bounds do not apply" if tiling else "do not tile images"
        if tiling and wrong in TILE_SET:
            kind = f"do not take it (they take {', '.join(allowed)})"
        raise _bad(wrong, f"{spec.family} checkpoints {kind}")
    most = spec.image.max_tiles
    settings = {k: _integer(k, raw[k], 1, most) for k in TILE_KEYS[:2] if k in raw}
    for key in ("crop_to_patches", *SWITCH_KEYS):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise _bad(key, f"must be true or false, got {raw[key]!r}")
            settings[key] = raw[key]
    if tiling is not None and tiling.crops_key in raw:
        settings[tiling.crops_key] = _crop_cap(raw, settings, tiling)
    _check_order(settings, "min_patches", "max_patches")
    return settings


def _crop_cap(raw: dict[str, Any], settings: dict[str, Any], tiling: Tiling) -> int:
    """The most crops beside the whole image, which only a request that turns the switch on
    may ask for (off, the cap would change nothing: a 400 rather than a field ignored)."""
    key = tiling.crops_key
    if not any(settings.get(k) is True for k in SWITCH_KEYS):
        raise _bad(key, f"applies only with {' or '.join(SWITCH_KEYS)} true")
    return _integer(key, raw[key], 1, tiling.switched_on - 1)


def _check_order(settings: dict[str, Any], low: str, high: str) -> None:
    if low in settings and high in settings and settings[low] > settings[high]:
        raise _bad(low, f"must not exceed {high} ({settings[low]} > {settings[high]})")


def request_spec(spec: ProcessorSpec, settings: dict[str, Any]) -> ProcessorSpec:
    """The server's spec with the request's settings (the spec itself without any). Pixel bounds
    apply to images and video frames; frame settings to videos only. A bound the request leaves
    out keeps the server's, unless that would cross the one it gave."""
    if not settings:
        return spec
    pixels = {k: settings[k] for k in PIXEL_KEYS if k in settings}
    image = _tiled(_bounded(spec.image, pixels), settings, spec)
    frames = {k: settings[k] for k in ("fps", "num_frames", *FRAME_KEYS) if k in settings}
    if "min_frames" not in frames and "max_frames" in frames:
        frames["min_frames"] = min(spec.video.min_frames, frames["max_frames"])
    video = _bounded(spec.video, pixels, **frames)
    if video.min_frames > video.max_frames:
        raise _bad("min_frames", f"must not exceed max_frames ({video.max_frames})")
    return dataclasses.replace(spec, image=image, video=video)


def _tiled(config: Any, settings: dict[str, Any], spec: ProcessorSpec) -> Any:
    """The image config with the request's tile counts; without cropping, one tile (the whole
    image resized to it, no thumbnail); a switch turned on: the family's tiles for it."""
    switch = next((settings[k] for k in SWITCH_KEYS if k in settings), None)
    if switch is not None:
        tiling = spec.model_family.tiling
        most = tiling.switched_on if switch and tiling is not None else 1
        if tiling is not None and tiling.crops_key in settings:
            most = 1 + settings[tiling.crops_key]
        return dataclasses.replace(config, min_tiles=1, max_tiles=most)
    if settings.get("crop_to_patches") is False:
        return dataclasses.replace(config, min_tiles=1, max_tiles=1)
    most = settings.get("max_patches", config.max_tiles)
    least = settings.get("min_patches", min(config.min_tiles, most))
    return dataclasses.replace(config, min_tiles=least, max_tiles=max(least, most))


def _bounded(config: Any, pixels: dict[str, int], **other: Any) -> Any:
    low = pixels.get("min_pixels", config.min_pixels)
    high = pixels.get("max_pixels", config.max_pixels)
    if "min_pixels" not in pixels:
        low = min(low, high)
    if "max_pixels" not in pixels:
        high = max(low, high)
    return dataclasses.replace(config, min_pixels=low, max_pixels=high, **other)
