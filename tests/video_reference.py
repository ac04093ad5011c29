"""Oracles for the video path, for tests only: frames read straight with decord, and whole frames
resized at once and patchified. The served path (`media.worker.process_video_bytes`) must match."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from runtime.families.qwen2_vl import smart_resize
from tokenizer_manager.media.video_processor import (
    VideoProcessingConfig,
    clip_frames,
    frames_to_patches,
    resize_frame,
    sample_frame_indices,
)


def read_frames(data: bytes, cfg: VideoProcessingConfig) -> tuple[np.ndarray, float]:
    """All sampled frames at full size, and the frame rate of the kept frames."""
    import decord

    reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=1)
    total, fps = len(reader), float(reader.get_avg_fps())
    indices = sample_frame_indices(total, fps, **cfg.sampling_kwargs())
    return reader.get_batch(indices).asnumpy(), len(indices) / total * fps


def preprocess_video(frames: Any, **settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 frames [T, H, W, 3] -> (pixel values [t*h*w, patch dim], grid [1, 3])."""
    cfg = VideoProcessingConfig(**settings)
    stack = np.stack([np.asarray(frame) for frame in frames])
    factor = cfg.patch_size * cfg.merge_size
    clip = clip_frames(len(stack), cfg.temporal_patch_size, cfg.clip_budget)
    height, width = smart_resize(
        stack.shape[1], stack.shape[2], factor, cfg.min_pixels, cfg.max_pixels, *clip
    )
    resized = np.stack([resize_frame(frame, height, width) for frame in stack])
    patches, grid = frames_to_patches(resized, cfg)
    return torch.from_numpy(patches), torch.tensor([grid], dtype=torch.long)
