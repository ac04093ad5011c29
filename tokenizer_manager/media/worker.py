"""The media worker processes' side: decode, resize, patchify, digest and export one item.

These are plain module-level functions over picklable arguments (`cpu_pool.WorkerPool` jobs; also
callable in-process). Images go through the checkpoint's HF image processor, built once per
worker. Videos are identified from their bytes and opened here, inside the worker, only through
the demuxer allowlist (`video_container.open_container`); only numpy arrays leave the worker
(invariant 8, docs/architecture.md). A client's bad media raises `MediaError`, which pickles back
to the parent as the request's 4xx.
"""

from __future__ import annotations

import collections
import functools
import itertools
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np

from runtime.allocator import freeze_startup_objects, keep_freed_memory
from runtime.logging_utils import get_logger
from runtime.multimodal import Modality
from runtime.transport.shm import SharedTensor
from tokenizer_manager.media.limits import MediaLimits, bad_video
from tokenizer_manager.media.load import decode_image
from tokenizer_manager.media.multimodal_inputs import digest_int, new_digest
from tokenizer_manager.media.types import (
    MediaFile,
    ProcessedMedia,
    ProcessorSpec,
    check_media_shape,
    input_bytes,
)
from tokenizer_manager.media.video_container import (
    check_video_header,
    check_video_length,
    open_container,
    read_header,
    video_container,
    video_errors,
)
from tokenizer_manager.media.video_processor import (
    VideoProcessingConfig,
    frame_timestamps,
    frames_to_patches,
    resize_frame,
    sample_frame_indices,
    second_per_grid_t,
    tile_patches,
)

logger = get_logger(__name__)

FRAME_CHUNK = 8  # video frames decoded at once before they are resized down


@functools.lru_cache(maxsize=4)
def image_processor(model_path: str) -> Any:
    """The checkpoint's HF image processor, built once per process and path."""
    from transformers import AutoImageProcessor  # processing code only, no modeling code

    return AutoImageProcessor.from_pretrained(model_path)


def init_worker(model_path: str) -> None:
    """Process-pool initializer: leave Ctrl-C to the parent and build the processor up front."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()
    image_processor(model_path)
    freeze_startup_objects()


def media_digest(modality: Modality, data: bytes, spec: ProcessorSpec) -> int:
    """The item's identity: XXH3-128 over the encoded bytes and every setting that shapes its
    features (the checkpoint's processor, resize bounds, frame sampling); the encoder cache's
    and the processed-item cache's key. Hashing the encoded bytes costs a fraction of hashing the
    float32 patches they decode to, and is cheap enough to run on the event loop."""
    digest = new_digest()
    digest.update(f"{modality.value}|{spec!r}|".encode())
    digest.update(data)
    return digest_int(digest)


def export_pixels(pixels: np.ndarray, out_path: str | None) -> np.ndarray | SharedTensor:
    """The pixels written to `out_path` (a shared-memory file, so only its name travels), or
    the array itself without a path or when shared memory is full."""
    if out_path is None:
        return pixels
    try:
        return SharedTensor.write(pixels, out_path)
    except OSError as exc:
        logger.warning("media pixels through shared memory failed (%r); sending them inline", exc)
        return pixels


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def process_image_bytes(
    data: bytes | MediaFile, spec: ProcessorSpec, limits: MediaLimits, out_path: str | None = None
) -> ProcessedMedia:
    """Decode image bytes and run the checkpoint's image processor; the pixels go to `out_path`
    in shared memory when one is given (see `export_pixels`)."""
    data = input_bytes(data)
    image = decode_image(data, limits)
    check_media_shape(image.height, image.width, "image_url")
    tiled = spec.model_family.tiling is not None
    pixels, grid = tiled_image(image, spec) if tiled else resized_image(image, spec)
    if grid != spec.image_grid(image.height, image.width):  # what its header was charged
        raise RuntimeError(f"the image processor gave grid {grid}, the family's rule another")
    digest = media_digest(Modality.IMAGE, data, spec)
    return ProcessedMedia(Modality.IMAGE, export_pixels(pixels, out_path), grid, digest=digest)


def resized_image(image: Any, spec: ProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The processor's patches of the image resized within the spec's pixel bounds."""
    size = {"shortest_edge": spec.image.min_pixels, "longest_edge": spec.image.max_pixels}
    out = image_processor(spec.model_path)(images=[image], return_tensors="np", size=size)
    pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    return pixels, tuple(int(x) for x in out["image_grid_thw"][0])


def tiled_image(image: Any, spec: ProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The processor's tiles of the image (a tiling family's: `Family.tiling`), as patch rows."""
    cfg, tiling = spec.image, spec.model_family.tiling
    assert tiling is not None
    kwargs = tiling.processor_kwargs(cfg.min_tiles, cfg.max_tiles)
    tiles = image_processor(spec.model_path)(images=[image], return_tensors="np", **kwargs)
    return tile_patches(tiles["pixel_values"], cfg.patch_size)


# ---------------------------------------------------------------------------------------------
# Videos
# ---------------------------------------------------------------------------------------------


def process_video_bytes(
    data: bytes | MediaFile, spec: ProcessorSpec, limits: MediaLimits, out_path: str | None = None
) -> ProcessedMedia:
    """The one video path: open the video (here, inside the worker), sample frames, resize them
    chunk by chunk (full-size frames never pile up in memory) and patchify."""
    data = input_bytes(data)
    cfg = spec.video
    frames, sampled_fps, times = read_resized_frames(data, spec, limits)
    patches, grid = frames_to_patches(frames, cfg)
    seconds = second_per_grid_t(sampled_fps, cfg.temporal_patch_size)
    digest = media_digest(Modality.VIDEO, data, spec)
    pixels = export_pixels(patches, out_path)
    return ProcessedMedia(Modality.VIDEO, pixels, grid, seconds, digest, times)


def read_resized_frames(
    data: bytes, spec: ProcessorSpec, limits: MediaLimits
) -> tuple[np.ndarray, float, tuple[float, ...]]:
    """Sampled frames, already resized to the video's target size (the family's resize rule
    over `spec.video`), their frame rate, and the
    timestamp of each temporal patch. The container is opened once, through the allowlist
    (`video_container.open_container`), and its header checked before any frame is decoded."""
    if not data:
        raise bad_video("the video data is empty")
    cfg = spec.video
    with open_container(data, video_container(data)) as container:
        check_video_header(read_header(container), limits)
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        video_fps = float(stream.average_rate or 0)
        total = _frame_count(stream, container, video_fps)
        check_video_length(total, total / max(video_fps, 1e-3), limits)
        indices = _sample(total, video_fps, cfg)
        frames = _wanted_frames(container, stream, indices)
        chunks = _resized_chunks(frames, len(indices), spec, limits)
    at = spec.model_family.video_stamp.at
    times = frame_timestamps(indices, video_fps, cfg.temporal_patch_size, at)
    return np.concatenate(chunks), len(indices) / total * video_fps, times


def _frame_count(stream: Any, container: Any, video_fps: float) -> int:
    """The declared frame count, else the duration times the frame rate."""
    if stream.frames:
        return int(stream.frames)
    return int(video_fps * (container.duration or 0) / 1_000_000)


def _sample(total: int, video_fps: float, cfg: VideoProcessingConfig) -> list[int]:
    try:
        return sample_frame_indices(total, video_fps, **cfg.sampling_kwargs())
    except ValueError as exc:
        raise bad_video(f"cannot sample the video: {exc}") from exc


def _wanted_frames(container: Any, stream: Any, indices: list[int]) -> Iterator[np.ndarray]:
    """The frames at `indices` (ascending, repeats allowed) as RGB arrays, decoded in order and
    stopped after the last one; a video shorter than declared repeats its last frame."""
    wanted = collections.Counter(indices)
    frame, sent = None, 0
    try:
        for index, decoded in enumerate(container.decode(stream)):
            if index in wanted:
                frame = decoded.to_ndarray(format="rgb24")
                yield from itertools.repeat(frame, wanted[index])
                sent += wanted[index]
            if sent == len(indices):
                return
    except video_errors() as exc:
        raise bad_video("cannot decode the video frames: the data is corrupt") from exc
    if frame is None:
        raise bad_video("cannot decode the video frames: no frame at the sampled positions")
    yield from itertools.repeat(frame, len(indices) - sent)


def _resized_chunks(
    frames: Iterator[np.ndarray], count: int, spec: ProcessorSpec, limits: MediaLimits
) -> list[np.ndarray]:
    """The frames resized FRAME_CHUNK at a time to the size the first frame sets."""
    first = next(frames)
    size = _video_target_size(first.shape[0], first.shape[1], count, spec, limits)
    chunks = [_resize_all([first], size)]
    while batch := list(itertools.islice(frames, FRAME_CHUNK)):
        chunks.append(_resize_all(batch, size))
    return chunks


def _video_target_size(
    height: int, width: int, frames: int, spec: ProcessorSpec, limits: MediaLimits
) -> tuple[int, int]:
    if height * width > limits.max_pixels or min(height, width) < max(1, limits.min_side):
        raise bad_video(f"video frames are {width}x{height}: outside the allowed frame size")
    check_media_shape(height, width, "video_url")
    return spec.video_size(height, width, frames)


def _resize_all(frames: list[np.ndarray], size: tuple[int, int]) -> np.ndarray:
    return np.stack([resize_frame(frame, *size) for frame in frames])
