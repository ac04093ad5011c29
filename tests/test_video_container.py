"""Video bytes that could make FFmpeg open other files or URLs are refused before decord sees them.

Every listener here is on 127.0.0.1 and counts the connections it gets: none may arrive.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
from make_tiny_checkpoint import make_checkpoint

from tokenizer_manager.media import MediaError, MediaLimits
from tokenizer_manager.media_types import ProcessorSpec
from tokenizer_manager.media_worker import process_video_bytes
from tokenizer_manager.video_container import (
    AVI,
    MATROSKA,
    MP4,
    check_quicktime_references,
    video_container,
)


def encode(container: str, codec: str, frames: int = 8, size: tuple[int, int] = (64, 48)) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> ProcessorSpec:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("tiny"))
    return ProcessorSpec.from_checkpoint(str(folder), MediaLimits())


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode("mp4", "mpeg4")


class Listener:
    """A TCP listener on 127.0.0.1 that counts connections (and never answers)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stopped = True
        self.thread.join()
        self.sock.close()


@pytest.fixture()
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def hostile(kind: str, port: int, secret: Path) -> bytes:
    url = f"http://127.0.0.1:{port}"
    texts = {
        "hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n{url}/seg0.ts\n"
        f"#EXTINF:1,\nfile://{secret}\n#EXT-X-ENDLIST\n",
        "concat": f"ffconcat version 1.0\nfile '{secret}'\nfile '{url}/seg1.mp4'\n",
        "sdp": "v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\n"
        f"m=video {port} RTP/AVP 96\na=rtpmap:96 H264/90000\n",
        "dash": f'<?xml version="1.0"?>\n<MPD xmlns="urn:mpeg:dash:schema:mpd:2011"><Period>'
        f"<AdaptationSet><Representation><BaseURL>{url}/v.mp4</BaseURL></Representation>"
        "</AdaptationSet></Period></MPD>\n",
    }
    return texts[kind].encode()


@pytest.mark.parametrize("kind", ["hls", "concat", "sdp", "dash"])
def test_playlists_and_lists_never_reach_out(
    spec: ProcessorSpec, listener: Listener, tmp_path: Path, mp4: bytes, kind: str
) -> None:
    secret = tmp_path / "secret.mp4"
    secret.write_bytes(mp4)
    data = hostile(kind, listener.port, secret)
    with pytest.raises(MediaError) as info:
        process_video_bytes(data, spec, MediaLimits())
    assert (info.value.status, info.value.param, info.value.code) == (
        400,
        "video_url",
        "unsupported_video_format",
    )
    assert listener.connections == 0


def test_hls_playlist_sent_as_a_data_url_is_refused_end_to_end(
    spec: ProcessorSpec, listener: Listener, tmp_path: Path
) -> None:
    from runtime.multimodal import Modality
    from tokenizer_manager.media import load_media_bytes

    playlist = hostile("hls", listener.port, tmp_path / "x.ts")
    url = "data:video/mp4;base64," + base64.b64encode(playlist).decode()
    data = load_media_bytes(url, MediaLimits(), modality=Modality.VIDEO)
    with pytest.raises(MediaError, match="unsupported video format"):
        process_video_bytes(data, spec, MediaLimits())
    assert listener.connections == 0


def test_real_containers_pass(spec: ProcessorSpec, mp4: bytes) -> None:
    cases = {MP4: mp4, MATROSKA: encode("matroska", "mpeg4"), AVI: encode("avi", "mpeg4")}
    for demuxer, data in cases.items():
        assert video_container(data) == demuxer
        out = process_video_bytes(data, spec, MediaLimits())
        assert out.grid_thw[0] >= 1


def external_dref(mp4: bytes) -> bytes:
    """The same movie with its data reference marked as not self-contained (data elsewhere)."""
    at = mp4.index(b"dref")
    entry = at + 4 + 8  # past 'dref', version/flags and the entry count
    assert mp4[entry + 4 : entry + 8] in (b"url ", b"alis")
    out = bytearray(mp4)
    out[entry + 8 : entry + 12] = b"\0\0\0\0"
    return bytes(out)


def test_mp4_with_external_data_reference_is_refused(spec: ProcessorSpec, mp4: bytes) -> None:
    check_quicktime_references(mp4)
    with pytest.raises(MediaError, match="outside the file"):
        process_video_bytes(external_dref(mp4), spec, MediaLimits())


def test_header_limits_apply_before_decoding(spec: ProcessorSpec, mp4: bytes) -> None:
    for limits, match in (
        (MediaLimits(max_video_frames=7), "8 frames"),
        (MediaLimits(max_video_seconds=1.0), "lasts 2 s"),
        (MediaLimits(max_pixels=64 * 48 - 1), "frame size"),
    ):
        with pytest.raises(MediaError, match=match) as info:
            process_video_bytes(mp4, spec, limits)
        assert info.value.param == "video_url"
