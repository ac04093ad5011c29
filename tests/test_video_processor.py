"""Video preprocessing: smart_resize, frame sampling, decoding and the patch layout.

transformers' PIL image processor is the oracle: a video whose temporal pairs hold the same frame
must give exactly the patches the image processor gives for that frame.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict

import av
import numpy as np
import pytest
import torch
from numerics import assert_within_rounding
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)
from video_reference import preprocess_video, read_frames

from runtime.families.qwen2_vl import smart_resize
from tokenizer_manager.media.video_processor import (
    VideoProcessingConfig,
    sample_frame_indices,
    second_per_grid_t,
)

SMALL = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
PATCH_DIM = 3 * 2 * 14 * 14
FRAME_COUNT, VIDEO_FPS, HEIGHT, WIDTH = 16, 8, 48, 64


# ------------------------------------------------------------------------------ smart_resize


def _random_size(rng: random.Random) -> tuple[int, int]:
    height = int(10 ** rng.uniform(0, 3.7))
    width = max(1, int(height * 10 ** rng.uniform(-2.2, 2.2)))
    return height, width


@pytest.mark.parametrize(
    "factor,min_pixels,max_pixels",
    [(28, 56 * 56, 28 * 28 * 1280), (28, 128 * 28 * 28, 768 * 28 * 28), (32, 1024, 32 * 32 * 64)],
)
def test_smart_resize_matches_reference(factor: int, min_pixels: int, max_pixels: int) -> None:
    rng = random.Random(factor + min_pixels)
    checked = 0
    for _ in range(3000):
        height, width = _random_size(rng)
        try:
            expected = hf_smart_resize(height, width, factor, min_pixels, max_pixels)
        except ValueError:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(height, width, factor, min_pixels, max_pixels)
            continue
        assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected
        checked += 1
    assert checked > 2000


def test_smart_resize_bounds_and_errors() -> None:
    height, width = smart_resize(1080, 1920, 28, 56 * 56, 28 * 28 * 256)
    assert height % 28 == 0 and width % 28 == 0 and height * width <= 28 * 28 * 256
    assert smart_resize(10, 10, 28, 56 * 56, 28 * 28 * 256) == (56, 56)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2011)
    with pytest.raises(ValueError, match="too small"):
        smart_resize(0, 100)
    with pytest.raises(ValueError, match="too small"):
        smart_resize(10, 10, 28, 0, 28 * 28 * 4)


# ------------------------------------------------------------------------------ frame sampling


def test_sample_frame_indices_uniform_at_target_fps() -> None:
    assert sample_frame_indices(16, 8.0, fps=2.0) == [0, 5, 10, 15]
    indices = sample_frame_indices(300, 30.0, fps=2.0)
    assert len(indices) == 20 and indices[0] == 0 and indices[-1] == 299
    assert indices == sorted(set(indices))


def test_sample_frame_indices_clamps_and_rounds() -> None:
    assert len(sample_frame_indices(10_000, 1.0, fps=2.0)) == 768
    assert len(sample_frame_indices(100, 1.0, fps=2.0, max_frames=7)) == 6
    assert len(sample_frame_indices(100, 30.0, fps=0.5, min_frames=4)) == 4
    assert len(sample_frame_indices(40, 10.0, fps=1.5, temporal_patch_size=4)) == 4
    assert sample_frame_indices(3, 30.0) == [0, 2]
    assert sample_frame_indices(1, 30.0) == [0]


def test_sample_frame_indices_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no frames"):
        sample_frame_indices(0, 30.0)
    with pytest.raises(ValueError, match="positive"):
        sample_frame_indices(10, 0.0)
    with pytest.raises(ValueError, match="positive"):
        sample_frame_indices(10, 30.0, fps=0.0)


# ------------------------------------------------------------------------------ decoding


def _color(index: int) -> np.ndarray:
    return np.array([index * 15, 255 - index * 15, 100], dtype=np.uint8)


def _write_mp4(frame_count: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for index in range(frame_count):
            pixels = np.broadcast_to(_color(index), (HEIGHT, WIDTH, 3)).copy()
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def mp4_bytes() -> bytes:
    return _write_mp4(FRAME_COUNT)


def _check_frames(frames: np.ndarray, sampled_fps: float) -> None:
    assert frames.dtype == np.uint8 and frames.shape == (4, HEIGHT, WIDTH, 3)
    assert sampled_fps == pytest.approx(2.0)
    for frame, index in zip(frames, [0, 5, 10, 15]):
        mean = frame.reshape(-1, 3).mean(axis=0)
        # a flat colour through a lossy codec: the decoded mean stays within 8 of 255 levels
        assert np.abs(mean - _color(index)).max() < 8


def test_reference_reader_samples_frames(mp4_bytes: bytes) -> None:
    _check_frames(*read_frames(mp4_bytes, VideoProcessingConfig(fps=2.0)))
    frames, sampled_fps = read_frames(mp4_bytes, VideoProcessingConfig(fps=8.0, max_frames=6))
    assert frames.shape[0] == 6 and sampled_fps == pytest.approx(6 / 16 * 8)
    assert second_per_grid_t(sampled_fps, 2) == pytest.approx(2 / sampled_fps)


# ------------------------------------------------------------------------------ patch layout


def _random_frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def _image_reference(frame: np.ndarray, **settings: int) -> tuple[torch.Tensor, torch.Tensor]:
    processor = Qwen2VLImageProcessorPil(**settings)
    out = processor(images=[Image.fromarray(frame)], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("height,width", [(100, 150), (20, 30), (480, 640), (57, 333)])
def test_repeated_frame_matches_image_processor(height: int, width: int) -> None:
    frame = _random_frames(1, height, width, seed=height)[0]
    expected, expected_grid = _image_reference(frame, **SMALL)
    pixels, grid = preprocess_video(np.stack([frame, frame]), **SMALL)
    assert pixels.dtype == torch.float32 and grid.dtype == torch.long
    assert torch.equal(grid, expected_grid)
    # the same elementwise steps on both sides: see assert_pixels_match
    assert_pixels_match(pixels, expected)


def assert_pixels_match(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same resized uint8 values through three rounded elementwise steps on each side
    (rescale, subtract the mean, divide by the std): within 3 eps of the largest |value|."""
    assert_within_rounding(actual, expected, terms=3)


def _temporal_slots(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """[t*h*w, C*2*14*14] -> [t, h*w, 2 (temporal slot), C*14*14]."""
    t, h, w = grid[0].tolist()
    return pixels.reshape(t, h * w, 3, 2, 14 * 14).transpose(2, 3).reshape(t, h * w, 2, -1)


def _image_slot(frame: np.ndarray) -> torch.Tensor:
    expected, grid = _image_reference(frame, **SMALL)
    return _temporal_slots(expected, grid)[0, :, 0]


def test_distinct_frames_follow_image_layout_per_temporal_slot() -> None:
    frames = _random_frames(4, 90, 120, seed=4)
    pixels, grid = preprocess_video(frames, **SMALL)
    _, image_grid = _image_reference(frames[0], **SMALL)
    assert grid.tolist() == [[2, *image_grid[0, 1:].tolist()]]
    assert pixels.shape == (int(grid.prod()), PATCH_DIM)
    slots = _temporal_slots(pixels, grid)
    for index, frame in enumerate(frames):
        slot = slots[index // 2, :, index % 2]
        # the same elementwise steps on both sides: see assert_pixels_match
        assert_pixels_match(slot, _image_slot(frame))


def test_odd_frame_count_repeats_last_frame() -> None:
    frames = _random_frames(3, 64, 64, seed=3)
    pixels, grid = preprocess_video(frames, **SMALL)
    assert grid[0, 0].item() == 2
    slots = _temporal_slots(pixels, grid)
    last = _image_slot(frames[2])
    # the same elementwise steps on both sides: see assert_pixels_match
    assert_pixels_match(slots[1, :, 0], last)
    # the same elementwise steps on both sides: see assert_pixels_match
    assert_pixels_match(slots[1, :, 1], last)
    single, single_grid = preprocess_video(frames[:1], **SMALL)
    assert single_grid[0, 0].item() == 1
    # the same elementwise steps on both sides: see assert_pixels_match
    assert_pixels_match(single, _image_reference(frames[0], **SMALL)[0])


# ------------------------------------------------------------------------------ config


def test_config_from_preprocessor_config_matches_image_processor() -> None:
    file = {
        "min_pixels": 3136, "max_pixels": 50176, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 0.75],
        "image_processor_type": "Qwen2VLImageProcessor",
    }  # fmt: skip
    config = VideoProcessingConfig.from_preprocessor_config(file)
    assert (config.min_pixels, config.max_pixels) == (3136, 50176)
    assert config.image_std == (0.25, 0.5, 0.75)
    frame = _random_frames(1, 300, 200, seed=11)[0]
    settings = {key: file[key] for key in ("min_pixels", "max_pixels", "image_mean", "image_std")}
    expected, expected_grid = _image_reference(frame, **settings)
    pixels, grid = preprocess_video(np.stack([frame, frame]), **asdict(config))
    assert torch.equal(grid, expected_grid)
    # the same elementwise steps on both sides: see assert_pixels_match
    assert_pixels_match(pixels, expected)


def test_config_reads_size_layout_and_overrides() -> None:
    file = {"size": {"shortest_edge": 1000, "longest_edge": 2000}, "fps": 1.0, "max_frames": None}
    config = VideoProcessingConfig.from_preprocessor_config(file, max_frames=32)
    assert (config.min_pixels, config.max_pixels) == (1000, 2000)
    expected = {"fps": 1.0, "min_frames": 4, "max_frames": 32, "temporal_patch_size": 2}
    assert config.sampling_kwargs() == expected | {"clip_budget": False}
