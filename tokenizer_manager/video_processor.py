"""Video preprocessing for Qwen2-VL / Qwen2.5-VL / Qwen3-VL: frame sampling, decoding, resizing
and patchify.

Qwen3-VL's video processor differs in two rules (`clip_budget`): the pixel bounds hold for the
whole clip (temporal patches x height x width), and the sampled frame count is not rounded to
whole temporal patches (the last frame repeats to fill the final one).

Everything here is pure: functions take bytes, paths or frames and return numpy arrays or tensors.
A video file is opened only inside the calling process and only frames leave it, never a reader
object (readers cannot be pickled and may crash the process that holds them).

The patch layout matches the image path, so the vision tower treats a video as a stack of
temporal patch pairs: row order (grid_t, h / merge, w / merge, merge, merge), and each row holds
(channel, temporal_patch_size, patch_size, patch_size) values.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_ASPECT_RATIO = 200

Frames = np.ndarray | Sequence[Image.Image] | Sequence[np.ndarray]


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
    num_frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect kept.

    With `num_frames` and `temporal_factor` (Qwen3-VL videos) the bounds hold for the clip: the
    frame count rounded to whole temporal patches times the frame's pixels; a frame side shorter
    than `factor` is first scaled up to it (aspect kept)."""
    if height < 1 or width < 1:
        raise ValueError(f"image is too small to resize: {height}x{width}")
    if temporal_factor > 1 and min(height, width) < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:
        raise ValueError(f"image is too small to resize: {height}x{width} -> {h_bar}x{w_bar}")
    return h_bar, w_bar


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
) -> list[int]:
    """Indices of frames to keep: uniform over the video at `fps` frames per second.

    The count is clamped to [min_frames, max_frames] and to the video length, then rounded down to
    a multiple of `temporal_patch_size` (not with `clip_budget`, Qwen3-VL's rule). A video shorter
    than one temporal patch keeps all frames (preprocessing pads it by repeating the last one).
    """
    _check_sampling_args(total_frames, video_fps, fps)
    if clip_budget:
        count = _clip_count(total_frames, video_fps, fps, min_frames, max_frames)
    else:
        count = _sample_count(
            total_frames, video_fps, fps, min_frames, max_frames, temporal_patch_size
        )
    if count == 0:
        return list(range(total_frames))
    return np.linspace(0, total_frames - 1, count).round().astype(np.int64).tolist()


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


def _clip_count(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> int:
    wanted = int(total / video_fps * fps)
    return min(max(wanted, min_frames), max_frames, total)


def read_video_frames(
    data: bytes | str,
    *,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    temporal_patch_size: int = 2,
    clip_budget: bool = False,
) -> tuple[np.ndarray, float]:
    """Decode the sampled frames of a video given as bytes or a file path.

    Returns (frames uint8 [T, H, W, 3], sampled_fps), where sampled_fps is the frame rate of the
    kept frames. Raises ValueError when the data cannot be opened as a video.
    """
    reader = _open_video(data)
    total, video_fps = len(reader), float(reader.get_avg_fps())
    indices = sample_frame_indices(
        total, video_fps, fps, min_frames, max_frames, temporal_patch_size, clip_budget
    )
    frames = _decode_frames(reader, indices)
    del reader
    return frames, len(indices) / total * video_fps


def frame_timestamps(
    indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2
) -> tuple[float, ...]:
    """Seconds at the middle of each temporal patch of sampled frames `indices` (Qwen3-VL writes
    them into the prompt): the last index repeats to fill the final patch, then each patch's
    time is the mean of its first and last frame's. Pure."""
    if not indices or not video_fps > 0:
        raise ValueError("frame timestamps need sampled frames and a positive frame rate")
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / video_fps for i in padded]
    step = temporal_patch_size
    return tuple((times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step))


def second_per_grid_t(sampled_fps: float, temporal_patch_size: int = 2) -> float:
    """Seconds covered by one temporal patch of a video sampled at `sampled_fps`."""
    return temporal_patch_size / sampled_fps


def _open_video(data: bytes | str) -> Any:
    import decord  # imported here: only processes that decode videos need it

    if isinstance(data, bytes | bytearray) and len(data) == 0:
        raise ValueError("video data is empty")
    source = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    try:
        return decord.VideoReader(source, ctx=decord.cpu(0), num_threads=1)
    except (decord.DECORDError, RuntimeError, OSError) as exc:
        raise ValueError(f"cannot open video: {_describe(data)}") from exc


def _decode_frames(reader: Any, indices: list[int]) -> np.ndarray:
    import decord

    try:
        frames = reader.get_batch(indices).asnumpy()
    except (decord.DECORDError, RuntimeError, OSError) as exc:
        raise ValueError("cannot decode video frames") from exc
    return np.ascontiguousarray(frames, dtype=np.uint8)


def _describe(data: bytes | str) -> str:
    return f"{len(data)} bytes" if isinstance(data, bytes | bytearray) else repr(data)


# ---------------------------------------------------------------------------------------------
# Resize, normalize, patchify
# ---------------------------------------------------------------------------------------------


def preprocess_video(
    frames: Frames,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    image_mean: Sequence[float] = CLIP_MEAN,
    image_std: Sequence[float] = CLIP_STD,
    rescale_factor: float = 1 / 255,
    clip_budget: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames -> (pixel_values_videos [t*h*w, C*tps*ps*ps] float32, video_grid_thw [1, 3] long)."""
    stack = frames_to_array(frames)
    height, width = smart_resize(
        stack.shape[1],
        stack.shape[2],
        patch_size * merge_size,
        min_pixels,
        max_pixels,
        *clip_frames(len(stack), temporal_patch_size, clip_budget),
    )
    resized = np.stack([resize_frame(frame, height, width) for frame in stack])
    pixels = normalize_frames(resized, rescale_factor, image_mean, image_std)
    pixels = pad_temporal(pixels, temporal_patch_size)
    patches, grid = patchify(pixels, patch_size, temporal_patch_size, merge_size)
    return torch.from_numpy(patches), torch.tensor([grid], dtype=torch.long)


def clip_frames(num_frames: int, temporal_patch_size: int, clip_budget: bool) -> tuple[int, int]:
    """(num_frames, temporal_factor) for `smart_resize`: the clip's, or one frame's."""
    return (num_frames, temporal_patch_size) if clip_budget else (1, 1)


def frames_to_array(frames: Frames) -> np.ndarray:
    """Frames as one uint8 array [T, H, W, 3]; PIL frames are converted to RGB."""
    if isinstance(frames, np.ndarray):
        stack = frames
    else:
        stack = np.stack([_frame_array(frame) for frame in frames]) if len(frames) else None
    if stack is None or stack.ndim != 4 or stack.shape[0] == 0 or stack.shape[-1] != 3:
        shape = None if stack is None else stack.shape
        raise ValueError(f"expected frames of shape [T>0, H, W, 3], got {shape}")
    if stack.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames, got {stack.dtype}")
    return stack


def _frame_array(frame: Image.Image | np.ndarray) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    return np.asarray(frame)


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

    @classmethod
    def from_preprocessor_config(
        cls, config: Mapping[str, Any], **overrides: Any
    ) -> VideoProcessingConfig:
        """Read the known keys of a preprocessor_config.json / video_preprocessor_config.json.

        Pixel bounds come from `min_pixels` / `max_pixels` or `size.shortest_edge` /
        `size.longest_edge`; keyword overrides win over the file.
        """
        values = {**_pixel_bounds(config), **_known_keys(config), **overrides}
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(float(x) for x in values[key])
        return cls(**values)

    def sampling_kwargs(self) -> dict[str, Any]:
        keys = ("fps", "min_frames", "max_frames", "temporal_patch_size", "clip_budget")
        return {key: getattr(self, key) for key in keys}

    def preprocess_kwargs(self) -> dict[str, Any]:
        keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels")
        keys += ("image_mean", "image_std", "rescale_factor", "clip_budget")
        return {key: getattr(self, key) for key in keys}

    def read(self, data: bytes | str) -> tuple[np.ndarray, float]:
        return read_video_frames(data, **self.sampling_kwargs())

    def preprocess(self, frames: Frames) -> tuple[torch.Tensor, torch.Tensor]:
        return preprocess_video(frames, **self.preprocess_kwargs())


CLIP_BUDGET_PROCESSORS = ("Qwen3VLVideoProcessor",)


def checkpoint_video_config(model_path: str | Path, **fallback: Any) -> VideoProcessingConfig:
    """A checkpoint's video settings: its own video_preprocessor_config.json when that names a
    processor with Qwen3-VL's rules (pixel bounds, fps and frame counts all from the file), else
    preprocessor_config.json with `fallback` (e.g. video pixel bounds) winning over the file."""
    video = _read_json(Path(model_path) / "video_preprocessor_config.json")
    if video.get("video_processor_type") in CLIP_BUDGET_PROCESSORS:
        return VideoProcessingConfig.from_preprocessor_config(video, clip_budget=True)
    config = _read_json(Path(model_path) / "preprocessor_config.json")
    return VideoProcessingConfig.from_preprocessor_config(config, **fallback)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


_CONFIG_KEYS = (
    "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
    "rescale_factor", "fps", "min_frames", "max_frames",
)  # fmt: skip


def _known_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in _CONFIG_KEYS if config.get(key) is not None}


def _pixel_bounds(config: Mapping[str, Any]) -> dict[str, int]:
    size = config.get("size") or {}
    bounds = {
        "min_pixels": config.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": config.get("max_pixels", size.get("longest_edge")),
    }
    return {key: int(value) for key, value in bounds.items() if value is not None}
