"""Video preprocessing: frame sampling, resizing and patchify (the target size is the family's
resize rule, `Family.resize`).

Everything here is pure: functions take frames and settings and return numpy arrays. Decoding
lives in the media worker (`worker.process_video_bytes`, the one video path): a video is
opened only inside that process and only frames leave it, never a reader object.

The patch layout matches the image path, so the vision tower treats a video as a stack of
temporal patch pairs: row order (grid_t, h / merge, w / merge, merge, merge), and each row holds
(channel, temporal_patch_size, patch_size, patch_size) values.

Qwen3-VL's video processor differs in two rules (`clip_budget`): the pixel bounds hold for the
whole clip (temporal patches x height x width), and the sampled frame count is not rounded to
whole temporal patches (the last frame repeats to fill the final one). Its prompt stamps every
temporal patch with the time of its frames (`frame_timestamps`). GLM-4.1V's has the clip budget
too, and its own sampling rule (`sampling="interval"`: `interval_frame_indices`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from runtime.families import family_for

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


# ---------------------------------------------------------------------------------------------
# Frame sampling and decoding
# ---------------------------------------------------------------------------------------------


def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    temporal_patch_size: int = 2,
    clip_budget: bool = False,
    num_frames: int | None = None,
    sampling: str = "uniform",
    max_duration: float = 300.0,
) -> list[int]:
    """Indices of frames to keep: uniform over the video at `fps` frames per second.

    The count is clamped to [min_frames, max_frames] and to the video length, then rounded down to
    a multiple of `temporal_patch_size` (not with `clip_budget`, Qwen3-VL's rule). A video shorter
    than one temporal patch keeps all frames (preprocessing pads it by repeating the last one).
    `num_frames` (a request's) asks for that many frames instead, rounded to whole temporal
    patches as HF's Qwen2-VL video processor rounds it; more than the video has is a ValueError.
    `sampling="interval"` picks one frame per 1 / fps seconds instead
    (`interval_frame_indices`)."""
    _check_sampling_args(total_frames, video_fps, fps)
    if sampling == "interval":
        return interval_frame_indices(total_frames, video_fps, fps, max_frames, max_duration)
    if num_frames is not None:
        count = _fixed_count(total_frames, num_frames, temporal_patch_size, clip_budget)
    elif clip_budget:
        count = _clip_count(total_frames, video_fps, fps, min_frames, max_frames)
    else:
        count = _sample_count(
            total_frames, video_fps, fps, min_frames, max_frames, temporal_patch_size
        )
    if count == 0:
        return list(range(total_frames))
    return np.linspace(0, total_frames - 1, count).round().astype(np.int64).tolist()


def interval_frame_indices(
    total: int, video_fps: float, fps: float, max_frames: int, max_duration: float = 300.0
) -> list[int]:
    """The "interval" rule (GLM-4.1V's video processor's): the first frame at or after every
    1 / fps seconds of a video up to `max_duration` long (at least one), else
    `max_duration * fps` frames spread over the whole video; repeats dropped, and the last frame
    repeated to an even count. tessera also spreads them so that at most `max_frames` are kept
    (the server's frame bound). Pure."""
    duration, last = total / video_fps, total - 1
    count = max(math.floor(duration * fps), 1)
    if duration <= max_duration and count <= max_frames:
        picked = [min(last, math.ceil(i * video_fps / fps)) for i in range(count)]
    else:
        count = min(int(max_duration * fps), max_frames)
        if count >= total:
            picked = list(range(total))
        else:
            seconds = np.linspace(0, duration, count, endpoint=True)
            picked = [min(last, math.ceil(t * video_fps)) for t in seconds]
    kept = list(dict.fromkeys(picked))
    return kept + kept[-1:] if len(kept) % 2 else kept


def _check_sampling_args(total_frames: int, video_fps: float, fps: float) -> None:
    if total_frames < 1:
        raise ValueError("video has no frames")
    if not video_fps > 0 or not fps > 0:
        raise ValueError(f"frame rates must be positive (video {video_fps}, target {fps})")


def _sample_count(
    total: int, video_fps: float, fps: float, min_frames: int, max_frames: int, tps: int
) -> int:
    lower = math.ceil(min_frames / tps) * tps
    upper = math.floor(min(max_frames, total) / tps) * tps
    wanted = total / video_fps * fps
    count = min(max(wanted, lower), upper, total)
    return math.floor(count / tps) * tps


def _fixed_count(total: int, num_frames: int, tps: int, clip_budget: bool) -> int:
    count = num_frames if clip_budget else max(tps, round(num_frames / tps) * tps)
    if count > total:
        raise ValueError(f"{count} frames asked for, the video has {total}")
    return count


def _clip_count(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> int:
    wanted = int(total / video_fps * fps)
    return min(max(wanted, min_frames), max_frames, total)


def frame_timestamps(
    indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2, at: str = "middle"
) -> tuple[float, ...]:
    """Seconds of each temporal patch of sampled frames `indices` (Qwen3-VL and GLM-4.1V write
    them into the prompt): the last index repeats to fill the final patch, then each patch's
    time is the mean of its first and last frame's (`at="middle"`) or its first frame's
    (`at="first"`). Pure."""
    if not indices or not video_fps > 0:
        raise ValueError("frame timestamps need sampled frames and a positive frame rate")
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / video_fps for i in padded]
    step = temporal_patch_size
    last = 0 if at == "first" else step - 1
    return tuple((times[i] + times[i + last]) / 2 for i in range(0, len(times), step))


def second_per_grid_t(sampled_fps: float, temporal_patch_size: int = 2) -> float:
    """Seconds covered by one temporal patch of a video sampled at `sampled_fps`."""
    return temporal_patch_size / sampled_fps


# ---------------------------------------------------------------------------------------------
# Resize, normalize, patchify
# ---------------------------------------------------------------------------------------------


def clip_frames(num_frames: int, temporal_patch_size: int, clip_budget: bool) -> tuple[int, int]:
    """(num_frames, temporal_factor) for the family's resize rule: the clip's, or one frame's."""
    return (num_frames, temporal_patch_size) if clip_budget else (1, 1)


def frames_to_patches(
    frames: np.ndarray, cfg: VideoProcessingConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 frames [T, H, W, 3], already at their target size -> (patches, grid): normalize,
    pad the frame count to whole temporal patches, patchify."""
    pixels = normalize_frames(frames, cfg.rescale_factor, cfg.image_mean, cfg.image_std)
    pixels = pad_temporal(pixels, cfg.temporal_patch_size)
    return patchify(pixels, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic resize of one uint8 [H, W, 3] frame (PIL takes the size as width, height)."""
    resized = Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC)
    return np.asarray(resized)


def normalize_frames(
    frames: np.ndarray, rescale_factor: float, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:
    """uint8 [T, H, W, C] -> float32 (x * rescale_factor - mean) / std, per channel."""
    scaled = (frames.astype(np.float64) * rescale_factor).astype(np.float32)
    mean32, std32 = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return (scaled - mean32) / std32


def pad_temporal(frames: np.ndarray, temporal_patch_size: int) -> np.ndarray:
    """Repeat the last frame until the frame count is a multiple of `temporal_patch_size`."""
    missing = -frames.shape[0] % temporal_patch_size
    if missing == 0:
        return frames
    return np.concatenate([frames, np.repeat(frames[-1:], missing, axis=0)])


def patchify(
    frames: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float [T, H, W, C] (T a multiple of tps) -> (patches [t*h*w, C*tps*ps*ps], (t, h, w))."""
    frame_count, height, width, channels = frames.shape
    grid = (frame_count // temporal_patch_size, height // patch_size, width // patch_size)
    blocks = frames.transpose(0, 3, 1, 2).reshape(
        grid[0], temporal_patch_size, channels,
        grid[1] // merge_size, merge_size, patch_size,
        grid[2] // merge_size, merge_size, patch_size,
    )  # fmt: skip
    # -> (t, h blocks, w blocks, merge row, merge col, channel, tps, patch row, patch col)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = blocks.reshape(grid[0] * grid[1] * grid[2], -1)
    return np.ascontiguousarray(rows, dtype=np.float32), grid


def tile_patches(tiles: np.ndarray, patch_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Square tiles float [n, C, S, S] -> (patches [n * (S/p)**2, C*p*p], (n, S/p, S/p)): each
    tile's patches in row-major order, each row (channel, patch row, patch col). Pure."""
    count, channels, size, _ = tiles.shape
    side = size // patch_size
    blocks = tiles.reshape(count, channels, side, patch_size, side, patch_size)
    rows = blocks.transpose(0, 2, 4, 1, 3, 5).reshape(count * side * side, -1)
    return np.ascontiguousarray(rows, dtype=np.float32), (count, side, side)


# ---------------------------------------------------------------------------------------------
# Settings from a checkpoint
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoProcessingConfig:
    """Video preprocessing settings, usually read from a checkpoint's processor config file."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    clip_budget: bool = False  # Qwen3-VL: pixel bounds per clip, frame count not rounded
    num_frames: int | None = None  # a request's fixed frame count (instead of fps)
    sampling: str = "uniform"  # the family's frame rule (`Family.video_sampling`)
    max_duration: float = 300.0  # GLM-4.1V: longer videos are sampled over their whole length
    # A tiling family's images (`Family.tiling`): the tile side (`size.height`) and tile counts
    tile_size: int = 0
    min_tiles: int = 1
    max_tiles: int = 1

    @classmethod
    def from_preprocessor_config(
        cls, config: Mapping[str, Any], **overrides: Any
    ) -> VideoProcessingConfig:
        """Read the known keys of a preprocessor_config.json / video_preprocessor_config.json.

        Pixel bounds come from `min_pixels` / `max_pixels` or `size.shortest_edge` /
        `size.longest_edge`; keyword overrides win over the file.
        """
        values = {**_pixel_bounds(config), **_tiles(config), **_known_keys(config), **overrides}
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(float(x) for x in values[key])
        return cls(**values)

    def sampling_kwargs(self) -> dict[str, Any]:
        keys = ("fps", "min_frames", "max_frames", "temporal_patch_size", "clip_budget")
        fixed = {} if self.num_frames is None else {"num_frames": self.num_frames}
        if self.sampling != "uniform":
            fixed |= {"sampling": self.sampling, "max_duration": self.max_duration}
        return {key: getattr(self, key) for key in keys} | fixed


def checkpoint_video_config(
    model_path: str | Path, image_config: Mapping[str, Any] | None = None, **fallback: Any
) -> VideoProcessingConfig:
    """A checkpoint's video settings: its own video_preprocessor_config.json when that names a
    processor its family reads with the clip budget (`Family.clip_budget_video_processors`:
    pixel bounds, fps and frame counts all from the file), else
    preprocessor_config.json (`image_config` when the caller has read it already) with
    `fallback` (e.g. video pixel bounds) winning over the file."""
    video = read_json(Path(model_path) / "video_preprocessor_config.json")
    family = family_for(read_json(Path(model_path) / "config.json"))
    rule = {"sampling": family.video_sampling}
    if video.get("video_processor_type") in family.clip_budget_video_processors:
        return VideoProcessingConfig.from_preprocessor_config(video, clip_budget=True, **rule)
    if image_config is None:
        image_config = read_json(Path(model_path) / "preprocessor_config.json")
    return VideoProcessingConfig.from_preprocessor_config(image_config, **fallback, **rule)


def read_json(path: Path) -> dict[str, Any]:
    """A processor config file's keys ({} when the checkpoint has no such file)."""
    return json.loads(path.read_text()) if path.is_file() else {}


_CONFIG_KEYS = (
    "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
    "rescale_factor", "fps", "min_frames", "max_frames", "max_duration",
)  # fmt: skip


def _known_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in _CONFIG_KEYS if config.get(key) is not None}


def _tiles(config: Mapping[str, Any]) -> dict[str, int]:
    """Tile settings of a square `size` {height, width} with `min_patches` / `max_patches`."""
    size = config.get("size") or {}
    if "height" not in size or size.get("width") != size["height"]:
        return {}
    keys = {"tile_size": size["height"], "min_tiles": config.get("min_patches", 1)}
    return {**keys, "max_tiles": config.get("max_patches", 1)}


def _pixel_bounds(config: Mapping[str, Any]) -> dict[str, int]:
    size = config.get("size") or {}
    bounds = {
        "min_pixels": config.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": config.get("max_pixels", size.get("longest_edge")),
    }
    return {key: int(value) for key, value in bounds.items() if value is not None}
