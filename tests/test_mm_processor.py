"""AsyncMMDataProcessor and its worker functions on a tiny checkpoint.

The oracles: transformers' image processor for images; for videos, frames read straight with
decord and resized whole (tests/video_reference.py).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image
from video_reference import preprocess_video, read_frames
from waits import wait_until_async

from runtime.multimodal import Modality
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.frames import from_frames, to_frames
from tokenizer_manager.media.limits import MediaError, MediaLimits, MediaUrlPolicy
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.media.multimodal_inputs import PreparedMedia
from tokenizer_manager.media.types import MediaRef, ProcessorSpec
from tokenizer_manager.media.video_processor import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VideoProcessingConfig,
)
from tokenizer_manager.media.worker import (
    export_pixels,
    process_image_bytes,
    process_video_bytes,
)

IMAGE, VIDEO = Modality.IMAGE, Modality.VIDEO
VIDEO_FPS, FRAMES = 8, 40  # 5 s: 10 frames sampled at 2 fps, decoded in two chunks


def noise_image(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def record_fetch_threads(mm: AsyncMMDataProcessor) -> dict[str, bool]:
    """Wrap `mm._fetch`; the dict it fills says, per URL, whether it ran on the calling thread
    (the event loop's)."""
    loop_thread = threading.current_thread()
    on_loop: dict[str, bool] = {}
    fetch = mm._fetch

    def recording_fetch(ref: MediaRef, *args: object) -> object:
        on_loop[ref.url] = threading.current_thread() is loop_thread
        return fetch(ref, *args)

    mm._fetch = recording_fetch
    return on_loop


def mp4_bytes(frames: int = FRAMES, size: tuple[int, int] = (64, 48)) -> bytes:
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for index in range(frames):
            frame = np.ascontiguousarray(np.roll(base, 5 * index, axis=1))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def mangled(data: bytes, seed: int = 0) -> bytes:
    """Random bytes overwritten past the file's first quarter (decord raises DECORDError)."""
    rng = np.random.default_rng(seed)
    out = bytearray(data)
    for position in rng.integers(len(out) // 4, len(out), 200):
        out[position] = int(rng.integers(0, 256))
    return bytes(out)


def data_url(data: bytes, kind: str) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("tiny-qwen2-vl")))


@pytest.fixture(scope="module")
def video() -> bytes:
    return mp4_bytes()


def hf_image(checkpoint: str, image: Image.Image) -> tuple[np.ndarray, tuple[int, ...]]:
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(checkpoint)(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


def reference_video(checkpoint: str, data: bytes, max_frames: int) -> tuple[np.ndarray, tuple]:
    config = json.loads((Path(checkpoint) / "preprocessor_config.json").read_text())
    frames, fps = read_frames(data, VideoProcessingConfig(max_frames=max_frames))
    pixels, grid = preprocess_video(
        frames,
        min_pixels=VIDEO_MIN_PIXELS,
        max_pixels=VIDEO_MAX_PIXELS,
        image_mean=config["image_mean"],
        image_std=config["image_std"],
    )
    return pixels.numpy(), (*(int(x) for x in grid[0]), 2 / fps)


# ------------------------------------------------------------------------------ worker functions


def test_spec_reads_the_checkpoint_and_caps_frames(checkpoint: str) -> None:
    spec = ProcessorSpec.from_checkpoint(checkpoint, MediaLimits(max_frames=6))
    assert (spec.video.min_pixels, spec.video.max_pixels) == (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    assert (spec.video.patch_size, spec.video.merge_size, spec.video.max_frames) == (14, 2, 6)
    custom = ProcessorSpec.from_checkpoint(checkpoint, MediaLimits(), video_max_pixels=28 * 28 * 4)
    assert custom.video.max_pixels == 28 * 28 * 4


def test_image_worker_matches_hf_processor(checkpoint: str) -> None:
    spec, limits = ProcessorSpec.from_checkpoint(checkpoint, MediaLimits()), MediaLimits()
    image = noise_image((70, 50), seed=0)
    result = process_image_bytes(png_bytes(image), spec, limits)
    pixels, grid = hf_image(checkpoint, image)
    assert result.modality == IMAGE and result.grid_thw == grid
    np.testing.assert_array_equal(result.pixel_values, pixels)
    with pytest.raises(MediaError) as info:
        process_image_bytes(png_bytes(noise_image((400, 1), seed=0)), spec, limits)
    assert info.value.param == "image_url" and "aspect ratio" in str(info.value)


def test_item_hash_covers_the_bytes_and_the_processor_settings(checkpoint: str) -> None:
    """The hash comes from the encoded bytes plus the settings, and reaches the item."""
    from runtime.model_config import ModelConfig
    from tokenizer_manager.media.multimodal_inputs import build_multimodal_inputs, content_hash

    limits = MediaLimits()
    spec = ProcessorSpec.from_checkpoint(checkpoint, limits)
    data = png_bytes(noise_image((70, 50), seed=0))
    first, again = (process_image_bytes(data, spec, limits) for _ in range(2))
    other = process_image_bytes(png_bytes(noise_image((70, 50), seed=1)), spec, limits)
    small = ProcessorSpec.from_checkpoint(checkpoint, limits, video_max_pixels=28 * 28 * 4)
    assert first.digest == again.digest and first.digest != other.digest
    assert process_image_bytes(data, small, limits).digest != first.digest
    assert process_video_bytes(mp4_bytes(), spec, limits).digest not in (None, first.digest)
    prepared = first.to_prepared()
    assert content_hash(prepared) == first.digest
    pixels_only = PreparedMedia(IMAGE, prepared.pixel_values, prepared.grid_thw)
    assert content_hash(pixels_only) != first.digest  # media built from pixels hash their pixels
    config = ModelConfig.from_dir(checkpoint)
    ids = [1, config.vision_start_token_id, *[config.image_token_id] * 6, 2]
    _, mm = build_multimodal_inputs(ids, [prepared], config)
    assert mm.items[0].hash == first.digest


@pytest.mark.parametrize("max_frames,grid_t", [(64, 5), (4, 2)])
def test_video_worker_matches_preprocess_video(
    checkpoint: str, video: bytes, max_frames: int, grid_t: int
) -> None:
    limits = MediaLimits(max_frames=max_frames)
    spec = ProcessorSpec.from_checkpoint(checkpoint, limits)
    result = process_video_bytes(video, spec, limits)
    pixels, (t, h, w, seconds) = reference_video(checkpoint, video, max_frames)
    assert result.modality == VIDEO and result.grid_thw == (t, h, w)
    assert t == grid_t
    assert result.second_per_grid_t == pytest.approx(seconds)
    np.testing.assert_array_equal(result.pixel_values, pixels)


def test_video_worker_refuses_bad_videos(checkpoint: str, video: bytes) -> None:
    spec = ProcessorSpec.from_checkpoint(checkpoint, MediaLimits())
    for data in (b"", b"not a video at all" * 10, video[: len(video) // 3], mangled(video)):
        with pytest.raises(MediaError) as info:
            process_video_bytes(data, spec, MediaLimits())
        assert (info.value.status, info.value.param) == (400, "video_url")
    with pytest.raises(MediaError, match="frame size"):
        process_video_bytes(video, spec, MediaLimits(max_pixels=64 * 48 - 1))


# ------------------------------------------------------------------------------ end to end


def assert_same(got: PreparedMedia, pixels: np.ndarray, grid: tuple[int, ...]) -> None:
    assert got.grid_thw == grid
    np.testing.assert_array_equal(got.pixel_values.numpy(), pixels)


def test_async_processor_end_to_end(checkpoint: str, video: bytes) -> None:
    images = [noise_image((70, 50), seed=1), noise_image((30, 90), seed=2)]
    refs = [
        MediaRef(IMAGE, data_url(png_bytes(images[0]), "image/png")),
        MediaRef(VIDEO, data_url(video, "video/mp4")),
        MediaRef(IMAGE, data_url(png_bytes(images[1]), "image/png")),
    ]
    limits = MediaLimits()
    mm = AsyncMMDataProcessor(
        checkpoint,
        limits,
        io_workers=2,
        cpu_workers=1,
        max_concurrent_calls=2,
        per_request_timeout=300.0,
    )

    async def run() -> tuple[list[PreparedMedia], list[MediaError], list[int]]:
        await mm.warmup()
        out = await mm.process(refs)
        errors = [await _error_of(mm.process(bad)) for bad in _bad_requests(refs, video)]
        return out, errors, mm.worker_pids()

    out, errors, pids = asyncio.run(run())
    assert [m.modality for m in out] == [IMAGE, VIDEO, IMAGE]
    for got, image in zip([out[0], out[2]], images):
        assert_same(got, *hf_image(checkpoint, image))
    pixels, (t, h, w, seconds) = reference_video(checkpoint, video, limits.max_frames)
    assert_same(out[1], pixels, (t, h, w))
    assert out[1].second_per_grid_t == pytest.approx(seconds)
    params = [(e.status, e.param, e.code) for e in errors]
    assert params == [
        (400, "video_url", "invalid_video"),  # raised in the worker process
        (400, "image_url", "invalid_image"),  # truncated: passes the header check, fails decoding
        (400, "image_url", "invalid_base64"),
    ]
    assert len(pids) == 1
    new_pids = asyncio.run(survive_a_worker_crash(mm, pids[0], refs[0]))
    assert len(new_pids) == 1 and new_pids != pids
    mm.shutdown()
    assert_processes_gone(pids + new_pids)


def test_pixels_come_back_in_shared_files_and_no_file_outlives_its_request(
    checkpoint: str, video: bytes, tmp_path: Path
) -> None:
    """With a shared-memory folder the workers write each item's pixels into a file there and
    only its name comes back; every way a request can end leaves no file behind."""
    image = noise_image((70, 50), seed=1)
    good = MediaRef(IMAGE, data_url(png_bytes(image), "image/png"))
    refs = [good, MediaRef(VIDEO, data_url(video, "video/mp4"))]
    bad = [good, MediaRef(IMAGE, "data:image/png;base64,###")]

    async def run() -> tuple[list[str], list[PreparedMedia], list[str], list[MediaError]]:
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), shm_dir=str(tmp_path)) as mm:
            await mm.warmup()
            out = await mm.process(refs)
            kinds = [type(m.pixel_values).__name__ for m in out]
            listed = sorted(os.listdir(tmp_path))
            assert listed == sorted(os.path.basename(m.pixel_values.path) for m in out)
            shared: list = []
            back = from_frames(to_frames(out, shared))  # as the scheduler receives it
            for handle in shared:
                handle.hand_off()
            del out, shared
            errors = [await _error_of(mm.process(bad))]
            mm._cpu.job_timeout = 1e-4  # the video job is killed mid-way: none decodes that fast
            errors.append(await _error_of(mm.process(refs[1:])))
            gc.collect()
            return kinds, back, listed, errors, os.listdir(tmp_path)

    kinds, back, listed, errors, left = asyncio.run(run())
    assert kinds == ["SharedTensor"] * 2
    assert all(name.startswith(f"tessera-media-{os.getpid()}-") for name in listed)
    np.testing.assert_array_equal(back[0].pixel_values.numpy(), hf_image(checkpoint, image)[0])
    pixels, _ = reference_video(checkpoint, video, MediaLimits().max_frames)
    np.testing.assert_array_equal(back[1].pixel_values.numpy(), pixels)
    assert [e.code for e in errors] == ["invalid_base64", "media_processing_timeout"]
    assert left == []  # received ones removed by the receiver, failed ones by their owner


def test_pixels_stay_inline_when_the_shared_file_cannot_be_written(tmp_path: Path) -> None:
    pixels = np.ones((2, 3), np.float32)
    assert export_pixels(pixels, str(tmp_path / "no-such-folder" / "x")) is pixels
    assert export_pixels(pixels, None) is pixels


async def survive_a_worker_crash(mm: AsyncMMDataProcessor, pid: int, ref: MediaRef) -> list[int]:
    """A worker killed while idle (as a decord crash would leave it) and a request sent at once,
    while the worker may still look alive: its job runs on a fresh worker, the request does not
    notice."""
    await mm.warmup()
    os.kill(pid, signal.SIGKILL)
    assert (await mm.process([ref]))[0].modality == IMAGE
    await mm.warmup()
    return mm.worker_pids()


def _bad_requests(refs: list[MediaRef], video: bytes) -> list[list[MediaRef]]:
    truncated = png_bytes(noise_image((64, 64), seed=4))[:3000]
    return [
        [refs[0], MediaRef(VIDEO, data_url(video[:500], "video/mp4"))],
        [MediaRef(IMAGE, data_url(truncated, "image/png")), refs[1]],
        [refs[2], MediaRef(IMAGE, "data:image/png;base64,###")],
    ]


async def _error_of(work: object) -> MediaError:
    try:
        await work  # type: ignore[misc]
    except MediaError as err:
        return err
    raise AssertionError("expected a MediaError")


def assert_processes_gone(pids: list[int]) -> None:
    import multiprocessing

    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------------------ limits and timeouts


class SlowHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        try:
            time.sleep(60)  # far longer than the request timeout below
            self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def slow_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_per_request_timeout_blames_the_slow_url(checkpoint: str, slow_server: str) -> None:
    async def run() -> tuple[MediaError, float]:
        async with AsyncMMDataProcessor(
            checkpoint,
            MediaLimits(http_timeout=30.0, url_policy=MediaUrlPolicy(allow_private=True)),
            io_workers=2,
            cpu_workers=1,
            max_concurrent_calls=4,
            per_request_timeout=1.0,
        ) as mm:
            start = time.perf_counter()
            refs = [MediaRef(IMAGE, f"{slow_server}/a.png"), MediaRef(VIDEO, f"{slow_server}/b")]
            err = await _error_of(mm.process(refs))
            return err, time.perf_counter() - start

    err, elapsed = asyncio.run(run())
    assert (err.status, err.param, err.code) == (400, "image_url", "media_timeout")
    # the 1 s request timeout, long before the server's 60 s answer, however loaded the machine
    assert elapsed < 30.0


def test_request_byte_budget_and_closed_processor(checkpoint: str) -> None:
    data = png_bytes(noise_image((40, 40), seed=6))
    limits = MediaLimits(max_request_bytes=len(data) * 3 // 2)
    mm = AsyncMMDataProcessor(checkpoint, limits, io_workers=1, cpu_workers=1)
    refs = [MediaRef(IMAGE, data_url(data, "image/png"))] * 2

    async def run() -> MediaError:
        err = await _error_of(mm.process(refs))
        await mm.close()
        return err

    err = asyncio.run(run())
    assert (err.status, err.param, err.code) == (400, "image_url", "media_too_large")
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(mm.process(refs))


# ------------------------------------------------------------------------ budgets and fairness


def test_image_tokens_are_checked_from_the_header_before_decoding(checkpoint: str) -> None:
    from test_media import png_header_only

    bomb = data_url(png_header_only(3000, 3000), "image/png")  # ~100 bytes, 9 M pixels declared
    small = data_url(png_bytes(noise_image((56, 56), seed=1)), "image/png")  # 4 tokens

    async def run() -> tuple[MediaError, list[PreparedMedia]]:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), cpu_workers=1, per_request_timeout=300
        ) as mm:
            await mm.warmup()  # a loaded machine may take long to start a worker
            err = await _error_of(mm.process([MediaRef(IMAGE, small), MediaRef(IMAGE, bomb)], 100))
            return err, await mm.process([MediaRef(IMAGE, small)], 4)

    err, ok = asyncio.run(run())
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert "260 tokens" in str(err) and "100" in str(err)  # 4 + 256 (the checkpoint's cap)
    assert ok[0].grid_thw == (1, 4, 4)


def test_memory_budget_waits_then_refuses() -> None:
    from tokenizer_manager.media.mm_processor import MemoryBudget

    async def run() -> tuple[MediaError, int]:
        impatient = MemoryBudget(100, max_wait=0.2)
        await impatient.acquire(60)
        err = await _error_of(impatient.acquire(60))
        # a wait that no loaded machine runs out of, so only the release can end it
        budget = MemoryBudget(100, max_wait=600)
        await budget.acquire(60)
        waiter = asyncio.ensure_future(budget.acquire(60))
        for _ in range(10):  # let the waiter run up to its wait
            await asyncio.sleep(0)
        assert not waiter.done()
        await budget.release(60)
        await waiter
        await budget.release(60)
        await budget.acquire(500)  # larger than the budget: admitted alone
        return err, budget.in_flight

    err, in_flight = asyncio.run(run())
    assert (err.status, err.code) == (503, "media_busy") and in_flight == 500


class DribbleHandler(BaseHTTPRequestHandler):
    """Sends a status line one byte every 0.25 s and never finishes its headers."""

    open_now = 0
    most_open = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        cls = DribbleHandler
        with cls.lock:
            cls.open_now += 1
            cls.most_open = max(cls.most_open, cls.open_now)
        try:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 40:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with cls.lock:
                cls.open_now -= 1

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture()
def dribble_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), DribbleHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    DribbleHandler.most_open = 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_dribbling_urls_cannot_starve_other_requests(checkpoint: str, dribble_server: str) -> None:
    limits = MediaLimits(http_timeout=6.0, url_policy=MediaUrlPolicy(allow_private=True))
    slow = [MediaRef(IMAGE, f"{dribble_server}/{i}.png") for i in range(4)]
    quick = [MediaRef(IMAGE, data_url(png_bytes(noise_image((56, 56), seed=2)), "image/png"))]

    async def run() -> tuple[list[MediaError], float, int]:
        async with AsyncMMDataProcessor(
            checkpoint,
            limits,
            net_workers=4,
            fetches_per_request=2,
            max_concurrent_calls=4,
            per_request_timeout=120,  # the flood fails on the fetch timeout, queued or not
        ) as mm:
            await mm.warmup()
            flood = [asyncio.ensure_future(_error_of(mm.process(slow))) for _ in range(3)]
            # every fetch thread holds a dribbling URL
            assert await wait_until_async(lambda: DribbleHandler.open_now >= 4)
            start = time.perf_counter()
            await mm.process(quick)
            latency = time.perf_counter() - start
            one_request_open = DribbleHandler.most_open
            return await asyncio.gather(*flood), latency, one_request_open

    errors, latency, most_open = asyncio.run(run())
    # starved, it would wait for the 6 s fetch timeout; it waits only for the CPU worker
    assert latency < 3.0, f"a data: URL image took {latency:.2f} s during the flood"
    assert most_open <= 4  # 3 requests x 2 fetches each, capped by 4 fetch threads
    assert {(e.status, e.param, e.code) for e in errors} == {
        (400, "image_url", "media_fetch_failed")
    }


def gradient_jpeg(side: int) -> bytes:
    ramp = np.tile(np.linspace(0, 255, side, dtype=np.uint8), (side, 1))
    buffer = io.BytesIO()
    Image.fromarray(np.stack([ramp] * 3, axis=-1)).save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


def test_an_image_past_its_cpu_time_fails_alone_and_its_worker_is_replaced(
    checkpoint: str,
) -> None:
    """A 49-megapixel JPEG (under 1 MB; about 1.2 s of CPU here) against a 0.2 s CPU deadline:
    its request gets a 400, the worker is replaced, a small image right after is served."""
    big = MediaRef(IMAGE, data_url(gradient_jpeg(7000), "image/jpeg"))
    small = MediaRef(IMAGE, data_url(png_bytes(noise_image((32, 32), 1)), "image/png"))
    limits = MediaLimits(max_cpu_seconds=0.2)

    async def run() -> tuple[MediaError, list[int], list[int], list[PreparedMedia]]:
        async with AsyncMMDataProcessor(checkpoint, limits, per_request_timeout=120.0) as mm:
            await mm.warmup()
            before = mm.worker_pids()
            err = await _error_of(mm.process([big]))
            served = await mm.process([small])
            return err, before, mm.worker_pids(), served

    err, before, after, served = asyncio.run(run())
    assert (err.status, err.param, err.code) == (400, "image_url", "media_processing_timeout")
    assert "CPU time" in str(err)
    assert len(after) == 1 and after != before
    assert served[0].grid_thw[0] == 1


def test_an_overrunning_job_fails_its_request_and_says_so(checkpoint: str, video: bytes) -> None:
    ref = MediaRef(VIDEO, data_url(video, "video/mp4"))

    async def run() -> tuple[MediaError, list[int], list[int]]:
        # no video decodes in 0.1 ms, on any machine
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), job_timeout=1e-4) as mm:
            await mm.warmup()
            before = mm.worker_pids()
            err = await _error_of(mm.process([ref]))
            await mm.warmup()
            return err, before, mm.worker_pids()

    err, before, after = asyncio.run(run())
    assert (err.status, err.param, err.code) == (400, "video_url", "media_processing_timeout")
    assert "took longer than" in str(err)
    assert len(after) == 1 and after != before


def test_large_data_urls_are_decoded_off_the_event_loop(checkpoint: str) -> None:
    """Decoding base64 and reading an image header grows with the URL: only a small data: URL
    is handled on the event loop; a megabyte-sized one goes to a thread (issue 26, item 5)."""
    small = data_url(png_bytes(noise_image((56, 56), seed=2)), "image/png")
    noisy = noise_image((640, 640), seed=3)
    large = data_url(png_bytes(noisy), "image/png")
    assert len(large) > 1 << 20  # incompressible noise: well past a megabyte of base64

    async def run() -> dict[str, bool]:
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), cpu_workers=1) as mm:
            on_loop = record_fetch_threads(mm)
            await mm.process([MediaRef(IMAGE, small), MediaRef(IMAGE, large)], 100_000)
        return on_loop

    on_loop = asyncio.run(run())
    assert on_loop == {small: True, large: False}


def test_the_media_workers_setting_reaches_the_pool(checkpoint: str) -> None:
    """launch.py builds the media processor with this factory: --media-workers N, N workers."""
    args = ServerArgs(model_path=checkpoint, device="cpu", media_workers=3).resolve()

    async def run() -> list[int]:
        async with AsyncMMDataProcessor.from_server_args(args) as mm:
            await mm.warmup()
            return mm.worker_pids()

    assert len(set(asyncio.run(run()))) == 3
    with pytest.raises(ValueError, match="media-workers"):
        AsyncMMDataProcessor.from_server_args(ServerArgs(model_path=checkpoint))  # not resolved
