"""AsyncMMDataProcessor: fetch, decode and preprocess a request's images and videos off the loop.

Two pools keep the asyncio loop free:
- an I/O thread pool fetches the bytes (data: URL, http(s), allowed local file) and reads image
  headers, so most bad media are refused before any CPU work;
- a small CPU process pool (started with `spawn`) decodes and preprocesses: images go through the
  checkpoint's HF image processor (built once per worker), videos are opened with decord inside
  the worker and only numpy arrays come back (invariant 8).

The worker functions are plain module-level functions over picklable arguments so the pool can
run them; they return `ProcessedMedia` (numpy) which the parent turns into `PreparedMedia`.
Content hashes are not computed here: `build_multimodal_inputs` does that once per item.

Errors: a client's bad media raises `MediaError` (400, param image_url / video_url). When a
request's media take longer than `per_request_timeout`, the error is blamed on the client
(400, code "media_timeout") if one of its items was still being fetched, since a slow or stalled
URL is the usual cause; if everything was already fetched and the time went into waiting for or
running our CPU workers, it is a 503 with the same code. A crashed worker process is our own
failure: the pool is replaced and a RuntimeError (a 500 upstream) is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import multiprocessing
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from runtime.logging_utils import get_logger
from runtime.multimodal import Modality
from tokenizer_manager.media import (
    MediaError,
    MediaLimits,
    decode_image,
    load_media_bytes,
    media_param,
    open_image,
)
from tokenizer_manager.media_fetch import MediaFetcher
from tokenizer_manager.multimodal_inputs import PreparedMedia
from tokenizer_manager.video_processor import (
    MAX_ASPECT_RATIO,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VideoProcessingConfig,
    normalize_frames,
    pad_temporal,
    patchify,
    resize_frame,
    sample_frame_indices,
    second_per_grid_t,
    smart_resize,
)

__all__ = [
    "AsyncMMDataProcessor",
    "MediaError",
    "MediaLimits",
    "MediaRef",
    "ProcessedMedia",
    "ProcessorSpec",
    "process_image_bytes",
    "process_video_bytes",
]

logger = get_logger(__name__)

FRAME_CHUNK = 8  # video frames decoded at once before they are resized down
WORKER_STOP_TIMEOUT = 5.0  # seconds close() waits for a busy worker before terminating it


@dataclass(frozen=True)
class MediaRef:
    """One image or video part of a request, in prompt order."""

    modality: Modality
    url: str


@dataclass(frozen=True)
class ProcessorSpec:
    """What a worker needs to preprocess media for one checkpoint (picklable)."""

    model_path: str
    video: VideoProcessingConfig

    @classmethod
    def from_checkpoint(
        cls,
        model_path: str,
        limits: MediaLimits,
        *,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
    ) -> ProcessorSpec:
        """Patch, merge, mean and std from preprocessor_config.json; video pixel bounds and the
        frame cap from the arguments (the image bounds in that file are for images only)."""
        config = _read_preprocessor_config(model_path)
        video = VideoProcessingConfig.from_preprocessor_config(
            config, min_pixels=video_min_pixels, max_pixels=video_max_pixels
        )
        video = dataclasses.replace(video, max_frames=min(video.max_frames, limits.max_frames))
        return cls(str(model_path), video)


def _read_preprocessor_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class ProcessedMedia:
    """A worker's result: numpy only, so it pickles as plain bytes between processes."""

    modality: Modality
    pixel_values: np.ndarray  # float32 [t*h*w patches, patch_dim]
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None

    def to_prepared(self) -> PreparedMedia:
        pixels = torch.from_numpy(self.pixel_values)
        return PreparedMedia(self.modality, pixels, self.grid_thw, self.second_per_grid_t)


# ---------------------------------------------------------------------------------------------
# Worker side: run inside the CPU process pool (also callable in-process)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def image_processor(model_path: str) -> Any:
    """The checkpoint's HF image processor, built once per process and path."""
    from transformers import AutoImageProcessor  # processing code only, no modeling code

    return AutoImageProcessor.from_pretrained(model_path)


def init_worker(model_path: str) -> None:
    """Process-pool initializer: leave Ctrl-C to the parent and build the processor up front."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    image_processor(model_path)


def worker_ready() -> bool:
    return True


def process_image_bytes(data: bytes, spec: ProcessorSpec, limits: MediaLimits) -> ProcessedMedia:
    """Decode image bytes and run the checkpoint's image processor."""
    image = decode_image(data, limits)
    _check_aspect_ratio(image.height, image.width, "image_url")
    out = image_processor(spec.model_path)(images=[image], return_tensors="np")
    pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    return ProcessedMedia(Modality.IMAGE, pixels, grid)


def _check_aspect_ratio(height: int, width: int, param: str) -> None:
    ratio = max(height, width) / max(1, min(height, width))
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"media is {width}x{height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}",
            param=param,
            code="invalid_media_size",
        )


def process_video_bytes(data: bytes, spec: ProcessorSpec, limits: MediaLimits) -> ProcessedMedia:
    """Open a video with decord (here, inside the worker), sample, resize and patchify frames.

    The result equals `preprocess_video(read_video_frames(data, ...))` with the same settings,
    but frames are resized chunk by chunk, so full-size frames never pile up in memory.
    """
    cfg = spec.video
    frames, sampled_fps = read_resized_frames(data, cfg, limits)
    pixels = normalize_frames(frames, cfg.rescale_factor, cfg.image_mean, cfg.image_std)
    pixels = pad_temporal(pixels, cfg.temporal_patch_size)
    patches, grid = patchify(pixels, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
    seconds = second_per_grid_t(sampled_fps, cfg.temporal_patch_size)
    return ProcessedMedia(Modality.VIDEO, patches, grid, seconds)


def read_resized_frames(
    data: bytes, cfg: VideoProcessingConfig, limits: MediaLimits
) -> tuple[np.ndarray, float]:
    """Sampled frames, already resized to the video's target size, and their frame rate."""
    reader = open_video_reader(data)
    try:
        total, video_fps = len(reader), float(reader.get_avg_fps())
        indices = _sample(total, video_fps, cfg)
        first = decode_frames(reader, indices[:1])
        size = _video_target_size(first.shape[1], first.shape[2], cfg, limits)
        chunks = [_resize_all(first, size)]
        for start in range(1, len(indices), FRAME_CHUNK):
            batch = decode_frames(reader, indices[start : start + FRAME_CHUNK])
            chunks.append(_resize_all(batch, size))
    finally:
        del reader
    return np.concatenate(chunks), len(indices) / total * video_fps


def open_video_reader(data: bytes) -> Any:
    import decord  # only CPU workers decode videos

    if not data:
        raise _bad_video("the video data is empty")
    try:
        return decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=1)
    except _video_errors() as exc:
        raise _bad_video("cannot open the video: not a supported video file") from exc


def _video_errors() -> tuple[type[Exception], ...]:
    """What decord raises for bad data: its own DECORDError (not a RuntimeError) or I/O errors."""
    import decord

    return (decord.DECORDError, RuntimeError, OSError, ValueError)


def _bad_video(message: str) -> MediaError:
    return MediaError(message, param="video_url", code="invalid_video")


def _sample(total: int, video_fps: float, cfg: VideoProcessingConfig) -> list[int]:
    try:
        return sample_frame_indices(total, video_fps, **cfg.sampling_kwargs())
    except ValueError as exc:
        raise _bad_video(f"cannot sample the video: {exc}") from exc


def decode_frames(reader: Any, indices: list[int]) -> np.ndarray:
    try:
        frames = reader.get_batch(indices).asnumpy()
    except _video_errors() as exc:
        raise _bad_video("cannot decode the video frames: the data is corrupt") from exc
    return np.ascontiguousarray(frames, dtype=np.uint8)


def _video_target_size(
    height: int, width: int, cfg: VideoProcessingConfig, limits: MediaLimits
) -> tuple[int, int]:
    if height * width > limits.max_pixels or min(height, width) < max(1, limits.min_side):
        raise _bad_video(f"video frames are {width}x{height}: outside the allowed frame size")
    _check_aspect_ratio(height, width, "video_url")
    factor = cfg.patch_size * cfg.merge_size
    return smart_resize(height, width, factor, cfg.min_pixels, cfg.max_pixels)


def _resize_all(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.stack([resize_frame(frame, *size) for frame in frames])


# ---------------------------------------------------------------------------------------------
# Parent side: the asyncio front end
# ---------------------------------------------------------------------------------------------


@dataclass
class _RequestState:
    """Per-request bookkeeping: bytes fetched so far and which items are still fetching."""

    max_bytes: int
    fetched_bytes: int = 0
    fetching: dict[int, Modality] = dataclasses.field(default_factory=dict)

    def add_bytes(self, count: int, modality: Modality) -> None:
        self.fetched_bytes += count
        if self.fetched_bytes > self.max_bytes:
            raise MediaError(
                f"the media of this request exceed {self.max_bytes} bytes in total",
                param=media_param(modality),
                code="media_too_large",
            )


class AsyncMMDataProcessor:
    """Turns a request's media references into `PreparedMedia`, in order, off the event loop."""

    def __init__(
        self,
        model_path: str,
        limits: MediaLimits,
        *,
        io_workers: int = 8,
        cpu_workers: int = 1,
        max_concurrent_calls: int = 32,
        per_request_timeout: float = 30.0,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
    ):
        self.limits = limits
        self.spec = ProcessorSpec.from_checkpoint(
            model_path, limits, video_min_pixels=video_min_pixels, video_max_pixels=video_max_pixels
        )
        self.cpu_workers = cpu_workers
        self.per_request_timeout = per_request_timeout
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="tessera-media-io")
        self._cpu = self._new_cpu_pool()
        self._fetcher = MediaFetcher(limits.url_policy, limits.http_timeout)
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._closed = False
        logger.info("media: %d I/O threads, %d CPU worker processes", io_workers, cpu_workers)

    def _new_cpu_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.cpu_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(self.spec.model_path,),
        )

    # ------------------------------------------------------------------ lifecycle
    async def warmup(self) -> None:
        """Start every CPU worker now (and build its processor) instead of on the first request."""
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._cpu, worker_ready) for _ in range(self.cpu_workers)]
        await asyncio.gather(*jobs)

    def worker_pids(self) -> list[int]:
        return list((self._cpu._processes or {}).keys())

    async def close(self) -> None:
        """Stop both pools; a busy worker gets a few seconds, then is terminated."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Blocking form of close(), for callers without an event loop."""
        self._closed = True
        _stop_process_pool(self._cpu)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._fetcher.close()

    async def __aenter__(self) -> AsyncMMDataProcessor:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ processing
    async def process(self, parts: list[MediaRef]) -> list[PreparedMedia]:
        """Fetch and preprocess every part; results keep the order of `parts`.

        Raises the first MediaError (in item order among the items that failed before the rest
        were cancelled), or MediaError with code "media_timeout" after `per_request_timeout`.
        """
        if self._closed:
            raise RuntimeError("the media processor is closed")
        if not parts:
            return []
        state = _RequestState(self.limits.max_request_bytes)
        work = self._process_all(parts, state)
        try:
            return await asyncio.wait_for(work, self.per_request_timeout)
        except asyncio.TimeoutError:
            raise self._timeout_error(state) from None

    def _timeout_error(self, state: _RequestState) -> MediaError:
        seconds = self.per_request_timeout
        if state.fetching:
            modality = state.fetching[min(state.fetching)]
            message = f"fetching this request's media took longer than {seconds:g} s"
            return MediaError(message, param=media_param(modality), code="media_timeout")
        message = f"the server could not preprocess this request's media within {seconds:g} s"
        return MediaError(message, status=503, param="messages", code="media_timeout")

    async def _process_all(
        self, parts: list[MediaRef], state: _RequestState
    ) -> list[PreparedMedia]:
        tasks = [
            asyncio.ensure_future(self._process_one(i, ref, state)) for i, ref in enumerate(parts)
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [task.result() for task in tasks]

    async def _process_one(self, index: int, ref: MediaRef, state: _RequestState) -> PreparedMedia:
        async with self._slots:
            state.fetching[index] = ref.modality
            data = await self._run(self._io, self._fetch, ref)
            del state.fetching[index]
            state.add_bytes(len(data), ref.modality)
            result = await self._run_cpu(ref.modality, data)
        return result.to_prepared()

    def _fetch(self, ref: MediaRef) -> bytes:
        """I/O thread: the bytes, plus a header check for images (no pixels decoded yet)."""
        data = load_media_bytes(ref.url, self.limits, modality=ref.modality, fetcher=self._fetcher)
        if ref.modality == Modality.IMAGE:
            open_image(data, self.limits).close()
        return data

    async def _run_cpu(self, modality: Modality, data: bytes) -> ProcessedMedia:
        work = process_image_bytes if modality == Modality.IMAGE else process_video_bytes
        pool = self._cpu
        try:
            return await self._run(pool, work, data, self.spec, self.limits)
        except BrokenProcessPool as exc:
            self._replace_broken_pool(pool)
            raise RuntimeError("a media worker process died while preprocessing") from exc

    def _replace_broken_pool(self, broken: ProcessPoolExecutor) -> None:
        if self._cpu is broken and not self._closed:
            logger.error("a media worker process died; starting a new CPU pool")
            self._cpu = self._new_cpu_pool()
            broken.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _run(pool: Executor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _stop_process_pool(pool: ProcessPoolExecutor) -> None:
    """Shut a pool down without waiting forever: busy workers are terminated after a grace time.

    Reads the executor's private `_processes` map: the standard library has no public way to
    terminate a worker that is stuck in a job.
    """
    processes = list((pool._processes or {}).values())
    stopper = threading.Thread(
        target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True
    )
    stopper.start()
    stopper.join(WORKER_STOP_TIMEOUT)
    if not stopper.is_alive():
        return
    for process in processes:
        if process.is_alive():
            logger.warning("terminating busy media worker %d", process.pid)
            process.terminate()
    stopper.join(WORKER_STOP_TIMEOUT)
