"""Media loading: data URLs, base64, local files, http(s) and image decoding limits."""

from __future__ import annotations

import base64
import dataclasses
import functools
import gzip
import io
import ipaddress
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runtime.multimodal import Modality
from tokenizer_manager.media import limits as media_limits
from tokenizer_manager.media.limits import (
    MediaError,
    MediaLimits,
    MediaUrlPolicy,
    address_is_public,
)
from tokenizer_manager.media.load import (
    decode_image,
    load_media_bytes,
    looks_like_base64,
    open_image,
)

IMAGE, VIDEO = Modality.IMAGE, Modality.VIDEO


def png_bytes(size: tuple[int, int] = (20, 30), mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is tiny."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
    return b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b"")


@contextmanager
def expect_error(
    param: str, code: str, status: int = 400
) -> Iterator[pytest.ExceptionInfo[MediaError]]:
    with pytest.raises(MediaError) as info:
        yield info
    err = info.value
    assert (err.status, err.param, err.code) == (status, param, code), str(err)


# ------------------------------------------------------------------------------ data URLs


def test_data_url_roundtrip_and_decode() -> None:
    data = png_bytes()
    assert load_media_bytes(data_url(data), MediaLimits(), modality=IMAGE) == data
    wrapped = data_url(data).replace("base64,", "base64,\n  ")
    assert load_media_bytes(wrapped, MediaLimits(), modality=IMAGE) == data
    image = decode_image(data, MediaLimits())
    assert image.mode == "RGB" and image.size == (20, 30)


def test_bad_base64_and_bad_data_urls() -> None:
    with expect_error("image_url", "invalid_base64"):
        load_media_bytes("data:image/png;base64,abc$def==", MediaLimits(), modality=IMAGE)
    with expect_error("video_url", "invalid_base64"):
        load_media_bytes("data:video/mp4;base64,abcde", MediaLimits(), modality=VIDEO)
    with expect_error("image_url", "invalid_data_url"):
        load_media_bytes("data:image/png,rawbytes", MediaLimits(), modality=IMAGE)
    with expect_error("image_url", "invalid_data_url"):
        load_media_bytes("data:image/png;base64", MediaLimits(), modality=IMAGE)
    with expect_error("image_url", "invalid_media_url"):
        load_media_bytes("   ", MediaLimits(), modality=IMAGE)


def test_raw_base64_is_accepted_but_not_confused_with_paths() -> None:
    data = png_bytes()
    raw = base64.b64encode(data).decode()
    assert load_media_bytes(raw, MediaLimits(), modality=IMAGE) == data
    assert not looks_like_base64("/srv/media/cat.png")
    assert not looks_like_base64("abcd")
    with expect_error("image_url", "unsupported_media_url"):
        load_media_bytes("/srv/media/cat.png", MediaLimits(), modality=IMAGE)
    with expect_error("image_url", "unsupported_media_url"):
        load_media_bytes("ftp://example.com/cat.png", MediaLimits(), modality=IMAGE)


def test_too_many_bytes_is_refused_before_decoding() -> None:
    data = png_bytes((64, 64))
    small = MediaLimits(max_image_bytes=len(data) - 1, max_video_bytes=len(data))
    with expect_error("image_url", "media_too_large"):
        load_media_bytes(data_url(data), small, modality=IMAGE)
    assert load_media_bytes(data_url(data), small, modality=VIDEO) == data
    with expect_error("image_url", "media_too_large"):
        load_media_bytes(data_url(b"x" * (len(data) + 10)), small, modality=IMAGE)


# ------------------------------------------------------------------------------ images


def test_not_an_image_zero_size_and_truncated() -> None:
    with expect_error("image_url", "invalid_image"):
        decode_image(b"definitely not an image", MediaLimits())
    with expect_error("image_url", "invalid_image"):
        decode_image(png_header_only(0, 0), MediaLimits())
    with expect_error("image_url", "invalid_image"):
        decode_image(png_header_only(7, 0), MediaLimits())
    with expect_error("image_url", "invalid_image"):
        decode_image(png_bytes((10, 10)), MediaLimits(min_side=11))
    data = png_bytes((64, 64))
    with expect_error("image_url", "invalid_image"):
        decode_image(data[: len(data) // 2], MediaLimits())


def test_pixel_limit_is_checked_from_the_header() -> None:
    with expect_error("image_url", "image_too_large"):
        decode_image(png_bytes((20, 30)), MediaLimits(max_pixels=20 * 30 - 1))
    assert decode_image(png_bytes((20, 30)), MediaLimits(max_pixels=20 * 30)).size == (20, 30)
    start = time.perf_counter()
    with expect_error("image_url", "image_too_large"):  # 64 M pixels declared, ~100 bytes sent
        open_image(png_header_only(8000, 8000), MediaLimits())
    with expect_error("image_url", "image_too_large"):  # beyond PIL's own bomb check
        decode_image(png_header_only(60000, 60000), MediaLimits())
    # refused from the header: nothing near decoding (or allocating) 64 M pixels, however loaded
    assert time.perf_counter() - start < 30.0


def test_transparency_and_palette_become_rgb() -> None:
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    buffer = io.BytesIO()
    clear.save(buffer, "PNG")
    image = decode_image(buffer.getvalue(), MediaLimits())
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)
    buffer = io.BytesIO()
    Image.new("P", (5, 3), 7).save(buffer, "GIF")
    assert decode_image(buffer.getvalue(), MediaLimits()).mode == "RGB"
    assert decode_image(png_bytes((6, 6), "L"), MediaLimits()).mode == "RGB"


def test_media_error_pickles_with_its_fields() -> None:
    err = MediaError("bad", status=400, param="video_url", code="invalid_video")
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.status, copy.param, copy.code) == (
        "bad",
        400,
        "video_url",
        "invalid_video",
    )


# ------------------------------------------------------------------------------ local files


@pytest.fixture()
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes(seed=1))
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(root / "sub" / "cat.png", root / "alias.png")
    return root


def test_local_files_inside_the_allowed_folder(media_root: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_root))
    expected = png_bytes()
    path = media_root / "sub" / "cat.png"
    assert load_media_bytes(str(path), limits, modality=IMAGE) == expected
    assert load_media_bytes(f"file://{path}", limits, modality=IMAGE) == expected
    assert load_media_bytes("sub/cat.png", limits, modality=IMAGE) == expected
    assert load_media_bytes(str(media_root / "alias.png"), limits, modality=IMAGE) == expected


def test_local_files_outside_or_disabled_are_refused(media_root: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_root))
    outside = media_root.parent / "secret.png"
    for url in (
        str(outside),
        f"file://{outside}",
        str(media_root / "escape.png"),
        f"{media_root}/sub/../../secret.png",
        "../secret.png",
    ):
        with expect_error("image_url", "local_media_forbidden"):
            load_media_bytes(url, limits, modality=IMAGE)
    with expect_error("video_url", "local_media_forbidden"):
        load_media_bytes(f"file://{media_root}/sub/cat.png", MediaLimits(), modality=VIDEO)
    with expect_error("image_url", "media_not_found"):
        load_media_bytes(str(media_root / "missing.png"), limits, modality=IMAGE)
    with expect_error("image_url", "media_not_found"):
        load_media_bytes(str(media_root / "sub"), limits, modality=IMAGE)
    with expect_error("image_url", "invalid_media_url"):
        load_media_bytes(f"file://example.com{media_root}/sub/cat.png", limits, modality=IMAGE)


def test_local_file_size_limit(media_root: Path) -> None:
    limits = MediaLimits(allowed_local_media_path=str(media_root), max_image_bytes=10)
    with expect_error("image_url", "media_too_large"):
        load_media_bytes(str(media_root / "sub" / "cat.png"), limits, modality=IMAGE)


# ------------------------------------------------------------------------------ http(s)

IMAGE_BODY = png_bytes((16, 16), seed=3)
LOCAL = MediaLimits(url_policy=MediaUrlPolicy(allow_private=True))  # our listeners are loopback


class Handler(BaseHTTPRequestHandler):
    hits: list[str] = []  # every request's path, in arrival order

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        Handler.hits.append(self.path)
        routes = {
            "/cat.png": lambda: self._send(IMAGE_BODY),
            "/big": lambda: self._send(b"x" * 50_000),
            "/big-unsized": lambda: self._send(b"x" * 50_000, sized=False),
            "/drip": self._drip,
            "/drip-headers": self._drip_headers,
            "/redirect": lambda: self._redirect("/cat.png"),
            "/redirect-self": lambda: self._redirect(f"http://127.0.0.1:{self._port()}/cat.png"),
            "/redirect-localhost": lambda: self._redirect(
                f"http://localhost:{self._port()}/cat.png"
            ),
            "/redirect-file": lambda: self._redirect("file:///etc/hostname"),
            "/redirect-loop": lambda: self._redirect("/redirect-loop"),
            "/gzip-cat": lambda: self._send(gzip.compress(IMAGE_BODY), encoding="gzip"),
            "/deflate-cat": lambda: self._send(zlib.compress(IMAGE_BODY), encoding="deflate"),
            "/gzip-bomb": lambda: self._send(zeros_gzip(), encoding="gzip"),
            "/gzip-gzip": lambda: self._send(gzip.compress(zeros_gzip()), encoding="gzip, gzip"),
            "/gzip-header-twice": lambda: self._send(
                gzip.compress(zeros_gzip()), encoding=("gzip", "gzip")
            ),
            "/br": lambda: self._send(IMAGE_BODY, encoding="br"),
        }
        try:
            routes.get(self.path, lambda: self.send_error(404))()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _port(self) -> int:
        return self.server.server_address[1]

    def _send(self, body: bytes, sized: bool = True, encoding: str | tuple[str, ...] = ()) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        for coding in (encoding,) if isinstance(encoding, str) else encoding:
            self.send_header("Content-Encoding", coding)
        if sized:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self) -> None:
        self.send_response(200)
        self.end_headers()
        for _ in range(600):  # a byte every 0.1 s for a minute
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.1)

    def _drip_headers(self) -> None:
        """A status line and headers one byte at a time (48 s in all): never a complete header
        block."""
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nX-Pad: " * 4:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.2)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


BOMB_BYTES = 256 << 20  # what the gzip bombs claim


@functools.cache
def zeros_gzip() -> bytes:
    """A gzip stream of BOMB_BYTES zeros (about 250 KB), built a megabyte at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    body = b"".join(packer.compress(block) for _ in range(BOMB_BYTES >> 20))
    return body + packer.flush()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_image_and_redirect(server: str) -> None:
    assert load_media_bytes(f"{server}/cat.png", LOCAL, modality=IMAGE) == IMAGE_BODY
    assert load_media_bytes(f"{server}/redirect", LOCAL, modality=IMAGE) == IMAGE_BODY


def test_an_origin_may_compress_with_gzip_or_deflate(server: str) -> None:
    for path in ("/gzip-cat", "/deflate-cat"):
        assert load_media_bytes(f"{server}{path}", LOCAL, modality=IMAGE) == IMAGE_BODY


@pytest.mark.parametrize(
    "path,code",
    [
        ("/gzip-bomb", "media_too_large"),  # 250 KB of gzip claiming 256 MB
        ("/gzip-gzip", "media_fetch_failed"),  # double gzip (a few KB), stacked in one header
        ("/gzip-header-twice", "media_fetch_failed"),  # the same in two headers
    ],
)
def test_compression_bombs_cost_no_more_than_the_byte_limit(
    server: str, path: str, code: str
) -> None:
    """The byte limit counts decoded bytes while they are decoded, stacked codings are refused,
    and no memory grows with what the body claims."""
    limits = dataclasses.replace(LOCAL, max_image_bytes=1 << 20)
    tracemalloc.start()
    try:
        with expect_error("image_url", code):
            load_media_bytes(f"{server}{path}", limits, modality=IMAGE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB held for a {BOMB_BYTES >> 20} MiB claim"


def test_unknown_encodings_are_refused(server: str) -> None:
    with expect_error("image_url", "media_fetch_failed"):
        load_media_bytes(f"{server}/br", LOCAL, modality=IMAGE)


def test_http_errors_do_not_reveal_the_network(server: str) -> None:
    messages = set()
    for url in (f"{server}/missing.png", f"http://127.0.0.1:{free_port()}/x.png"):
        with expect_error("image_url", "media_fetch_failed") as info:
            load_media_bytes(url, LOCAL, modality=IMAGE)
        messages.add(str(info.value))
    with expect_error("image_url", "media_fetch_failed") as info:
        load_media_bytes(f"{server}/cat.png", MediaLimits(), modality=IMAGE)  # refused address
    messages.add(str(info.value))
    assert messages == {"could not fetch the media URL"}
    limits = dataclasses.replace(LOCAL, max_image_bytes=10_000)
    for path in ("/big", "/big-unsized"):
        with expect_error("image_url", "media_too_large"):
            load_media_bytes(f"{server}{path}", limits, modality=IMAGE)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "127.1", "2130706433", "[::ffff:127.0.0.1]", "0.0.0.0"]
)
def test_loopback_is_refused_before_connecting(server: str, host: str) -> None:
    port = server.rsplit(":", 1)[1]
    before = len(Handler.hits)
    with expect_error("image_url", "media_fetch_failed"):
        load_media_bytes(f"http://{host}:{port}/cat.png", MediaLimits(), modality=IMAGE)
    assert len(Handler.hits) == before, "the listener saw a connection"


@pytest.mark.parametrize(
    "address,public",
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("::ffff:8.8.8.8", True),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("fec0::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:7f00:1::", False),  # 6to4 around 127.0.0.1
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 around 169.254.169.254
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),  # Teredo around 127.0.0.1
    ],
)
def test_address_rule(address: str, public: bool) -> None:
    assert address_is_public(ipaddress.ip_address(address)) is public


def test_every_redirect_hop_is_checked(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    only_ip = MediaLimits(
        url_policy=MediaUrlPolicy(allow_private=True, allowed_domains=("127.0.0.1",))
    )
    assert load_media_bytes(f"{server}/redirect", only_ip, modality=IMAGE) == IMAGE_BODY
    for path in ("/redirect-localhost", "/redirect-file", "/redirect-loop"):
        with expect_error("image_url", "media_fetch_failed"):
            load_media_bytes(f"{server}{path}", only_ip, modality=IMAGE)
    # The address rule runs again on the hop: the first address passes, the second does not.
    verdicts = iter([True, False])
    monkeypatch.setattr(media_limits, "address_is_public", lambda address: next(verdicts))
    before = len(Handler.hits)
    with expect_error("image_url", "media_fetch_failed"):
        load_media_bytes(f"{server}/redirect-self", MediaLimits(), modality=IMAGE)
    assert Handler.hits[before:] == ["/redirect-self"]


def test_connects_to_the_address_it_checked(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One lookup per connection: a second, different answer (DNS rebinding) is never asked."""
    real = socket.getaddrinfo
    lookups = []

    def counting(host: str, *args: object, **kwargs: object) -> list:
        lookups.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    url = server.replace("127.0.0.1", "localhost") + "/cat.png"
    assert load_media_bytes(url, LOCAL, modality=IMAGE) == IMAGE_BODY
    assert lookups[0] == "localhost"
    assert all(ipaddress.ip_address(host).is_loopback for host in lookups[1:])


def test_environment_proxies_are_ignored(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        before = len(Handler.hits)
        assert load_media_bytes(f"{server}/cat.png", LOCAL, modality=IMAGE) == IMAGE_BODY
        assert Handler.hits[before:] == ["/cat.png"]  # asked directly, not in proxy form
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.parametrize("path", ["/drip", "/drip-headers"])  # a slow body; headers byte by byte
def test_one_deadline_covers_the_whole_fetch(server: str, path: str) -> None:
    start = time.perf_counter()
    limits = dataclasses.replace(LOCAL, http_timeout=1.0)
    with expect_error("video_url", "media_fetch_failed"):
        load_media_bytes(f"{server}{path}", limits, modality=VIDEO)
    # every read is quicker than the timeout, so a per-read timeout would wait for the whole
    # drip (48 s or more): ending well before that shows one deadline, however loaded the machine
    assert time.perf_counter() - start < 24.0


def test_unreachable_url_is_a_quick_400() -> None:
    url = f"http://127.0.0.1:{free_port()}/cat.png"
    start = time.perf_counter()
    with expect_error("image_url", "media_fetch_failed") as info:
        load_media_bytes(url, dataclasses.replace(LOCAL, http_timeout=120.0), modality=IMAGE)
    # refused at once: well before the 120 s timeout, however loaded the machine
    assert time.perf_counter() - start < 60.0
    assert url not in str(info.value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ image modes


def saved(image: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def test_high_bit_depth_images_keep_their_tones() -> None:
    ramp16 = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (8, 1))
    image = decode_image(saved(Image.fromarray(ramp16)), MediaLimits())
    row = np.asarray(image)[0, :, 0]
    assert image.mode == "RGB" and row[0] == 0 and row[-1] == 255
    assert abs(int(row[32]) - 130) <= 2  # mid-grey stays mid-grey (PIL alone gives 255)


def rle8_bmp(width: int = 4, height: int = 2) -> bytes:
    """A palette BMP whose rows are run-length coded (BI_RLE8): each row one run of one index."""
    rows = b"".join(bytes([width, row % 2, 0, 0]) for row in range(height - 1))
    pixels = rows + bytes([width, 1, 0, 1])  # the last row, then end of bitmap
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixels), 2835, 2835, 2, 0)
    palette = bytes([0, 0, 0, 0, 255, 255, 255, 0])
    offset = 14 + len(info) + len(palette)
    header = b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset)
    return header + info + palette + pixels


def test_the_formats_users_send_are_decoded() -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (6, 10, 3), dtype=np.uint8)
    for fmt, exact in (("PNG", True), ("BMP", True), ("WEBP", False), ("JPEG", False)):
        image = decode_image(saved(Image.fromarray(pixels), fmt), MediaLimits())
        assert image.size == (10, 6) and image.mode == "RGB", fmt
        assert not exact or np.array_equal(np.asarray(image), pixels), fmt
    gif = decode_image(saved(Image.fromarray(pixels).convert("P"), "GIF"), MediaLimits())
    assert gif.size == (10, 6) and gif.mode == "RGB"


def test_other_formats_and_run_length_bmp_are_refused() -> None:
    image = Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))
    for fmt in ("TIFF", "PPM", "TGA", "ICO", "PCX"):
        with expect_error("image_url", "invalid_image"):
            decode_image(saved(image, fmt), MediaLimits())
    with expect_error("image_url", "unsupported_image_format"):
        open_image(rle8_bmp(), MediaLimits())  # refused from the header alone


def test_cmyk_palette_transparency_and_grey_alpha() -> None:
    cmyk = decode_image(saved(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG"), MediaLimits())
    red = cmyk.getpixel((1, 1))
    assert cmyk.mode == "RGB" and red[0] > 200 and red[1] < 60 and red[2] < 60
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    clear = decode_image(saved(palette, transparency=1), MediaLimits())
    assert clear.getpixel((0, 0)) == (255, 255, 255)
    grey = decode_image(saved(Image.new("LA", (4, 4), (40, 255))), MediaLimits())
    assert grey.getpixel((0, 0)) == (40, 40, 40)


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    upright = decode_image(saved(image, "JPEG", exif=exif, quality=95), MediaLimits())
    assert upright.size == (20, 40)
    top = upright.getpixel((10, 5))
    assert top[2] > 200 and top[0] < 60  # the blue half is now on top
