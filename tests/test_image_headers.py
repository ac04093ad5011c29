"""Bounded header work (issue 57b): an image whose header is made of many empty pieces (JPEG
marker segments, PNG chunks, GIF sub-blocks) is refused with a 400 naming image_url before PIL
walks it; one with somewhat many is read off the event loop; ordinary images, EXIF and ICC
included, are read as before."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import pytest
from hostile_inputs import jpeg, padded_jpeg
from PIL import Image
from test_mm_processor import record_fetch_threads

from runtime.multimodal import Modality
from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.image_headers import (
    INLINE_HEADER_PIECES,
    MAX_HEADER_PIECES,
    header_pieces,
)
from tokenizer_manager.media.limits import MediaError, MediaLimits
from tokenizer_manager.media.load import open_image
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.media.types import MediaRef


def png_with_chunks(chunks: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "PNG")
    data = buf.getvalue()
    chunk = struct.pack(">I", 0) + b"prVt" + struct.pack(">I", zlib.crc32(b"prVt"))
    at = data.index(b"IDAT") - 4
    return data[:at] + chunk * chunks + data[at:]


def gif_with_blocks(blocks: int) -> bytes:
    buf = io.BytesIO()
    Image.new("P", (16, 16)).save(buf, "GIF")
    data = buf.getvalue()
    at = data.index(b",")  # the image descriptor
    return data[:at] + b"\x21\xfe" + b"\x01x" * blocks + b"\x00" + data[at:]


def exif_icc_jpeg(icc_bytes: int = 200_000) -> bytes:
    """A camera-like JPEG: EXIF (APP1) and an ICC profile (200 KB: four APP2 chunks)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    exif[0x010F] = "tessera camera"
    return jpeg((48, 32), exif=exif.tobytes(), icc_profile=b"\x00" * icc_bytes)


def test_ordinary_headers_have_few_pieces() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "PNG")
    for data in (jpeg(), exif_icc_jpeg(), buf.getvalue(), gif_with_blocks(3)):
        assert 0 < header_pieces(data, MAX_HEADER_PIECES) <= INLINE_HEADER_PIECES
    assert header_pieces(b"RIFF....WEBPVP8 ", MAX_HEADER_PIECES) == 0  # read in C


@pytest.mark.parametrize(
    "data",
    [padded_jpeg(48_000), png_with_chunks(16_000), gif_with_blocks(95_000)],
    ids=["jpeg", "png", "gif"],
)
def test_a_header_of_empty_pieces_is_a_400_naming_image_url(data: bytes) -> None:
    assert header_pieces(data, MAX_HEADER_PIECES) == MAX_HEADER_PIECES + 1  # stopped at the cap
    with Image.open(io.BytesIO(data)) as image:  # PIL itself would read it (slowly)
        assert image.size == (16, 16) or image.size == (32, 24)
    with pytest.raises(MediaError) as refused:
        open_image(data, MediaLimits())
    assert refused.value.status == 400 and refused.value.param == "image_url"


def test_exif_and_icc_jpegs_still_open() -> None:
    with open_image(exif_icc_jpeg(), MediaLimits()) as image:
        assert image.size == (48, 32) and len(image.info["icc_profile"]) == 200_000
    with open_image(padded_jpeg(MAX_HEADER_PIECES - 10), MediaLimits()) as image:
        assert image.size == (32, 24)


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("tiny-qwen2-vl")))


def test_the_event_loop_reads_only_small_headers(checkpoint: str) -> None:
    """A small data: URL's header is read on the loop when it has few pieces, in a thread when
    it has more; one with too many is refused before PIL walks it."""
    plain, busy = data_url(exif_icc_jpeg(100_000)), data_url(padded_jpeg(4 * INLINE_HEADER_PIECES))
    hostile = data_url(padded_jpeg(48_000))  # 192 KB: small enough for the loop's path

    async def run() -> tuple[dict[str, bool], MediaError]:
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), cpu_workers=1) as mm:
            on_loop = record_fetch_threads(mm)
            refs = [MediaRef(Modality.IMAGE, plain), MediaRef(Modality.IMAGE, busy)]
            assert len(await mm.process(refs, 100_000)) == 2
            with pytest.raises(MediaError) as refused:
                await mm.process([MediaRef(Modality.IMAGE, hostile)], 100_000)
        return on_loop, refused.value

    on_loop, refused = asyncio.run(run())
    assert on_loop == {plain: True, busy: False, hostile: False}
    assert refused.status == 400 and refused.param == "image_url"
