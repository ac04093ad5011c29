"""Per-request media settings (`mm_processor_kwargs`): checked against the server's limits,
applied as HF's processor applies them, and part of every key an item is cached under."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from test_mm_processor import mp4_bytes
from test_server import Server, png_url, serve_then_check_teardown
from video_reference import preprocess_video, read_frames
from vlm_cases import Checkpoint, load_hf, noise_image, run_hf

from runtime.multimodal import Modality
from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.limits import MediaError, MediaLimits
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.media.multimodal_inputs import PreparedMedia
from tokenizer_manager.media.settings import checked_settings, request_spec
from tokenizer_manager.media.types import MediaRef, ProcessorSpec
from tokenizer_manager.media.worker import process_image_bytes, process_video_bytes
from tokenizer_manager.protocol import APIError

IMAGE = Modality.IMAGE
PICTURE = noise_image((112, 140), seed=3)  # 20 tokens at the server's bounds, 2 at SMALL
SMALL = {"max_pixels": 56 * 56}
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("settings") / "qwen2_vl"))


@pytest.fixture(scope="module")
def spec(folder: str) -> ProcessorSpec:
    return ProcessorSpec.from_checkpoint(folder, MediaLimits())


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def hf_pixels(folder: str, image: Image.Image, **kwargs: int) -> tuple[np.ndarray, tuple]:
    """HF's PIL image processor for Qwen2-VL, with the checkpoint's settings and `kwargs`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil.from_pretrained(folder, **kwargs)
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


# ------------------------------------------------------------------------------ checks


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"max_pixels": 10**12}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 10}, "mm_processor_kwargs.min_pixels"),
        ({"max_pixels": "big"}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 6000, "max_pixels": 4000}, "mm_processor_kwargs.min_pixels"),
        ({"fps": 0}, "mm_processor_kwargs.fps"),
        ({"fps": 1000.0}, "mm_processor_kwargs.fps"),
        ({"max_frames": 10**6}, "mm_processor_kwargs.max_frames"),
        ({"min_frames": 8, "max_frames": 4}, "mm_processor_kwargs.min_frames"),
        ({"num_frames": 10**6}, "mm_processor_kwargs.num_frames"),
        ({"num_frames": 4, "fps": 1.0}, "mm_processor_kwargs.num_frames"),
        ({"size": {"longest_edge": 4}}, "mm_processor_kwargs.size"),
        ({"max_pixels": 3136, "do_resize": False}, "mm_processor_kwargs.do_resize"),
        ({"do_pan_and_scan": True}, "mm_processor_kwargs.do_pan_and_scan"),  # Gemma 3's
        ({"max_patches": 2}, "mm_processor_kwargs.max_patches"),  # InternVL's
        ({"pan_and_scan_max_num_crops": 2}, "mm_processor_kwargs.pan_and_scan_max_num_crops"),
    ],
)
def test_out_of_range_and_unknown_keys_are_refused_by_name(
    spec: ProcessorSpec, raw: dict, param: str
) -> None:
    with pytest.raises(APIError) as info:
        request_spec(spec, checked_settings(raw, spec))
    assert info.value.status == 400 and info.value.param == param
    assert param.split(".")[1] in info.value.message
    if param.endswith(("patches", "scan", "crops")):  # a tiling key, on a family that resizes
        assert info.value.message.endswith("checkpoints do not tile images")


def test_settings_apply_to_images_and_videos(spec: ProcessorSpec) -> None:
    raw = {"min_pixels": 28 * 28, "max_pixels": 56 * 56, "fps": 1.0, "max_frames": 2}
    mine = request_spec(spec, checked_settings(raw, spec))
    assert (mine.image.min_pixels, mine.image.max_pixels) == (784, 3136)
    assert (mine.video.min_pixels, mine.video.max_pixels) == (784, 3136)
    assert (mine.video.fps, mine.video.max_frames, mine.video.min_frames) == (1.0, 2, 2)
    assert request_spec(spec, checked_settings({}, spec)) is spec
    # a bound the request leaves out keeps the server's unless it would cross the given one
    low = request_spec(spec, checked_settings({"max_pixels": 1000}, spec))
    assert (low.image.min_pixels, low.image.max_pixels) == (1000, 1000)


@pytest.mark.parametrize("kwargs", [SMALL, {"min_pixels": 200 * 200}, {"max_pixels": 84 * 84}])
def test_request_pixel_limits_equal_hf_image_processor(
    folder: str, spec: ProcessorSpec, kwargs: dict
) -> None:
    """The worker with the request's spec gives HF's pixels and grid for the same kwargs."""
    mine = request_spec(spec, checked_settings(kwargs, spec))
    out = process_image_bytes(png(PICTURE), mine, MediaLimits())
    pixels, grid = hf_pixels(folder, PICTURE, **kwargs)
    assert out.grid_thw == grid and grid != hf_pixels(folder, PICTURE)[1]
    np.testing.assert_allclose(out.pixel_values, pixels, rtol=0, atol=1e-6)
    assert mine.image_cost(PICTURE.height, PICTURE.width)[0] == int(np.prod(grid)) // 4


@pytest.mark.parametrize(
    "raw", [{"fps": 1.0}, {"max_frames": 4}, {"num_frames": 5}, {"max_pixels": 56 * 56}]
)
def test_request_video_settings_are_honoured(spec: ProcessorSpec, raw: dict) -> None:
    """fps, the frame cap and the pixel bound of a request shape the video as the reference
    decoder and preprocessing do with those settings, and differ from the server's own."""
    video = mp4_bytes()  # 5 s at 8 fps: 10 frames at the server's 2 fps
    request = request_spec(spec, checked_settings(raw, spec))
    out, mine = process_video_bytes(video, request, MediaLimits()), request.video
    frames, fps = read_frames(video, mine)
    pixels, grid = preprocess_video(
        frames,
        min_pixels=mine.min_pixels,
        max_pixels=mine.max_pixels,
        image_mean=mine.image_mean,
        image_std=mine.image_std,
    )
    assert out.grid_thw == tuple(int(x) for x in grid[0])
    assert out.second_per_grid_t == pytest.approx(2 / fps)
    np.testing.assert_array_equal(out.pixel_values, pixels.numpy())
    assert out.grid_thw != process_video_bytes(video, spec, MediaLimits()).grid_thw


def test_more_frames_than_the_video_has_is_the_clients_error(spec: ProcessorSpec) -> None:
    request = request_spec(spec, checked_settings({"num_frames": 60}, spec))
    with pytest.raises(MediaError) as info:
        process_video_bytes(mp4_bytes(), request, MediaLimits())  # 40 frames
    assert info.value.status == 400 and info.value.param == "video_url"
    assert "60 frames asked for" in info.value.message


def test_the_header_token_check_counts_the_requests_size(folder: str) -> None:
    """The image tokens checked from the header, before decoding, are those of the request's
    pixel bounds: the picture does not fit 10 tokens at the server's size, but fits at SMALL."""
    ref = MediaRef(IMAGE, png_url(PICTURE))

    async def run() -> tuple[str | None, list[PreparedMedia]]:
        async with AsyncMMDataProcessor(folder, MediaLimits()) as mm:
            small = request_spec(mm.spec, checked_settings(SMALL, mm.spec))
            try:
                await mm.process([ref], 10)
                refused = None
            except MediaError as exc:
                refused = exc.code
            return refused, await mm.process([ref], 10, spec=small)

    refused, served = asyncio.run(run())
    assert refused == "context_length_exceeded"
    assert served[0].grid_thw == hf_pixels(folder, PICTURE, **SMALL)[1]


def test_one_image_at_two_sizes_is_two_items_never_reused(folder: str) -> None:
    """The same bytes with other settings: another digest, grid and cache entry, also when the
    client names the item by the same uuid."""
    url = png_url(PICTURE)

    async def run() -> tuple[list[PreparedMedia], dict]:
        async with AsyncMMDataProcessor(folder, MediaLimits(), cache_bytes=64 << 20) as mm:
            small = request_spec(mm.spec, checked_settings(SMALL, mm.spec))
            out = await mm.process([MediaRef(IMAGE, url, uuid="pic")])
            out += await mm.process([MediaRef(IMAGE, url, uuid="pic")], spec=small)
            out += await mm.process([MediaRef(IMAGE, url)], spec=small)  # a hit, same size
            out += await mm.process([MediaRef(IMAGE, "", uuid="pic")], spec=small)  # by id
            return out, mm.cache.info()

    out, info = asyncio.run(run())
    assert out[0].grid_thw == hf_pixels(folder, PICTURE)[1]
    small_grid = hf_pixels(folder, PICTURE, **SMALL)[1]
    assert out[1].grid_thw == out[2].grid_thw == out[3].grid_thw == small_grid
    assert out[0].digest != out[1].digest == out[2].digest == out[3].digest
    assert (info["items"], info["misses"], info["hits"]) == (2, 2, 2)


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(Server(folder, log))


def hf_text(folder: str, **kwargs: int) -> str:
    """HF greedy output for the picture preprocessed by HF with `kwargs`."""
    ckpt = Checkpoint(Path(folder))
    pixels, grid = hf_pixels(folder, PICTURE, **kwargs)
    item = PreparedMedia(IMAGE, torch.from_numpy(pixels), grid)
    case = ckpt.case("settings", [item, "Describe."])
    run_hf(load_hf(Path(folder)), case, NEW_TOKENS)
    return ckpt.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)


def image_tokens(folder: str, **kwargs: int) -> int:
    return int(np.prod(hf_pixels(folder, PICTURE, **kwargs)[1])) // 4


def chat_body(**extra: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": png_url(PICTURE)}}]
    content.append({"type": "text", "text": "Describe."})
    return {
        "model": "qwen2_vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        **extra,
    }


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_two_sizes_of_one_image_end_to_end_equal_hf(server: Server, folder: str) -> None:
    """The same image at the server's size and at a request's max_pixels: two items (two
    cache misses, two prompt lengths), each answered as HF answers for that size; /tokenize
    and /generate count the request's size too."""
    plain = post(server, "/v1/chat/completions", chat_body()).json()
    small = post(server, "/v1/chat/completions", chat_body(mm_processor_kwargs=SMALL)).json()
    assert small["choices"][0]["message"]["content"] == hf_text(folder, **SMALL)
    assert plain["choices"][0]["message"]["content"] == hf_text(folder)
    tokens = small["usage"]["prompt_tokens"]
    fewer = image_tokens(folder) - image_tokens(folder, **SMALL)
    assert fewer == 18 and plain["usage"]["prompt_tokens"] - tokens == fewer
    count = post(server, "/tokenize", {**chat_body(mm_processor_kwargs=SMALL)}).json()["count"]
    assert count == tokens
    body = {
        "text": "Describe.",
        "image_data": png_url(PICTURE),
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    settings = ({}, {"mm_processor_kwargs": SMALL})
    native = [post(server, "/generate", body | kw).json() for kw in settings]
    lengths = [out["meta_info"]["prompt_tokens"] for out in native]
    assert lengths[0] - lengths[1] == fewer


@pytest.mark.parametrize(
    ("path", "kwargs", "param"),
    [
        ("/v1/chat/completions", {"max_pixels": 10**12}, "mm_processor_kwargs.max_pixels"),
        ("/v1/chat/completions", {"num_crops": 4}, "mm_processor_kwargs.num_crops"),
        ("/tokenize", {"fps": -1}, "mm_processor_kwargs.fps"),
        ("/generate", {"min_pixels": 1}, "mm_processor_kwargs.min_pixels"),
        ("/v1/completions", SMALL, "mm_processor_kwargs"),
    ],
)
def test_bad_settings_are_400s_naming_the_key(
    server: Server, path: str, kwargs: dict, param: str
) -> None:
    body: dict = chat_body(mm_processor_kwargs=kwargs)
    if path == "/generate":
        body = {"text": "hi", "image_data": png_url(PICTURE), "mm_processor_kwargs": kwargs}
    if path == "/v1/completions":
        body = {"model": "qwen2_vl", "prompt": "hi", "mm_processor_kwargs": kwargs}
    if path == "/tokenize":
        body.pop("max_tokens"), body.pop("temperature")
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
