"""Video bytes that could make FFmpeg open other files or URLs are refused, and a video is
decoded only through the demuxer allowlist, so no bytes can make FFmpeg open anything.

Every listener here is on 127.0.0.1 and counts the connections it gets: none may arrive.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest

from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.limits import MediaError, MediaLimits
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.video_container import (
    AVI,
    MATROSKA,
    MP4,
    check_quicktime_references,
    video_container,
)
from tokenizer_manager.media.worker import process_video_bytes


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
    from tokenizer_manager.media.load import load_media_bytes

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


# ------------------------------------------------------------------------------ demuxer allowlist

CHILD = """
import os, pickle, sys
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.limits import MediaError
from tokenizer_manager.media.worker import process_video_bytes

spec = pickle.load(open(sys.argv[1], "rb"))
good, hostile = (open(path, "rb").read() for path in sys.argv[2:4])
process_video_bytes(good, spec, MediaLimits())  # every import and lazy load happens here
os.access("/tessera-decode-start", os.F_OK)
try:
    process_video_bytes(hostile, spec, MediaLimits())
    outcome = "decoded"
except MediaError as exc:
    outcome = exc.code
os.access("/tessera-decode-end", os.F_OK)
print(outcome)
"""


def sdp_inside_mp4(mp4: bytes, port: int) -> bytes:
    """A real MP4 whose first box (`ftyp`, brand `jp2 `, 16 MB with no NUL byte) carries an SDP
    description. It sniffs as MP4 and opens as MP4 when the demuxer is named, but FFmpeg's own
    probe scores it as SDP (a jp2 brand scores 5 for MP4, a `c=IN IP4` line 50 for SDP), whose
    demuxer binds RTP sockets on the port it names."""
    size = 0x01010101  # the smallest box size without a NUL byte: SDP's probe stops at one
    sdp = (
        f"\nv=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\n"
        f"m=video {port} RTP/AVP 96\na=rtpmap:96 H264/90000\n"
    ).encode()
    head = (b"\x01\x01\x01\x01ftypjp2 " + sdp).ljust(size, b"\n")
    skip = struct.unpack_from(">I", mp4)[0]  # the original ftyp box
    rest = bytearray(mp4[skip:])
    at = rest.index(b"stco")  # chunk offsets are absolute: move them with the data
    for k in range(struct.unpack_from(">I", rest, at + 8)[0]):
        pos = at + 12 + 4 * k
        struct.pack_into(">I", rest, pos, struct.unpack_from(">I", rest, pos)[0] + size - skip)
    return head + bytes(rest)


def traced_calls(log: str) -> list[str]:
    """The network and open calls strace logged between the child's two markers."""
    lines = open(log).read().splitlines()
    start = next(i for i, line in enumerate(lines) if "tessera-decode-start" in line)
    end = next(i for i, line in enumerate(lines) if "tessera-decode-end" in line)
    calls = ("socket(", "bind(", "connect(", "sendto(", "open(", "openat(", "creat(")
    return [line for line in lines[start:end] if any(call in line for call in calls)]


def test_the_sniffed_demuxer_decodes_what_ffmpeg_would_probe_as_sdp(
    spec: ProcessorSpec, mp4: bytes
) -> None:
    """No strace needed: the movie decodes as the MP4 it sniffs as (left to probe the bytes,
    FFmpeg opens it as SDP and finds no video it can decode)."""
    hostile = sdp_inside_mp4(mp4, port=socket_free_udp_port())
    out = process_video_bytes(hostile, spec, MediaLimits())
    assert out.grid_thw == process_video_bytes(mp4, spec, MediaLimits()).grid_thw


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_decoding_opens_no_socket_and_no_file(
    spec: ProcessorSpec, mp4: bytes, tmp_path: Path
) -> None:
    hostile = sdp_inside_mp4(mp4, port=socket_free_udp_port())
    assert video_container(hostile) == MP4
    paths = [tmp_path / name for name in ("spec.pkl", "good.mp4", "hostile.mp4")]
    for path, data in zip(paths, (pickle.dumps(spec), mp4, hostile)):
        path.write_bytes(data)
    log = tmp_path / "strace.log"
    command = ["strace", "-f", "-qq", "-e", "trace=%network,%file", "-o", str(log)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [*command, sys.executable, "-c", CHILD, *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert traced_calls(str(log)) == []
    assert run.stdout.strip() == "decoded"  # it is a real MP4 when opened as one


def socket_free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
