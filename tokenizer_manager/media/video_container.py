"""Which video bytes may reach a decoder: real containers that cannot name other resources.

FFmpeg, left to itself, picks its demuxer from the bytes, and some of its demuxers open whatever
the data names: an HLS or DASH playlist fetches its segments, an ffconcat list opens files, an SDP
description opens network streams, and a QuickTime movie may point at external media through
data references. So the container is identified here from its magic number first, and only
these pass:

- MP4 / QuickTime (`ftyp`, or a QuickTime file starting with `moov`/`mdat`/`wide`/`free`/`skip`),
  when every data reference (`dref`) is self-contained and there is no reference movie (`rmra`);
- Matroska / WebM (EBML header);
- AVI (`RIFF....AVI `).

Everything else (playlists, concat lists, SDP, raw streams, unknown data) is a 400. Then the
video is opened only through `open_container`, for the header probe (frame count, duration and
frame size are checked before any frame is decoded) and for decoding alike: the demuxer named
explicitly, so FFmpeg never probes the bytes (a file that sniffs as MP4 here can score higher as
an SDP description in FFmpeg's own probe, whose demuxer binds RTP sockets), the in-memory buffer
as the only input, and no protocol for anything the file names.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

from tokenizer_manager.media.limits import MediaLimits, bad_video

# Demuxer names FFmpeg knows these containers by.
MP4, MATROSKA, AVI = "mov", "matroska", "avi"

_QUICKTIME_FIRST = {b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"}
# Boxes that hold other boxes on the way to a data reference; `meta` has 4 bytes of flags first.
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"dinf", b"meta", b"edts", b"udta"}
_MAX_BOXES = 10_000


def video_container(data: bytes) -> str:
    """The FFmpeg demuxer for `data`, or a MediaError when it is not an allowed container."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return AVI
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return MATROSKA
    if len(data) >= 8 and data[4:8] in _QUICKTIME_FIRST:
        check_quicktime_references(data)
        return MP4
    raise bad_video(
        "unsupported video format: send an MP4/MOV, Matroska/WebM or AVI file "
        "(playlists, concat lists and stream descriptions are refused)",
        code="unsupported_video_format",
    )


def check_quicktime_references(data: bytes) -> None:
    """Refuse a MOV/MP4 whose data references point outside the file."""
    for kind, start, end in _boxes(data, 0, len(data), depth=0, budget=[_MAX_BOXES]):
        if kind == b"rmra":
            raise bad_video("the video is a reference movie that names other files")
        if kind == b"dref" and not _dref_self_contained(data, start, end):
            raise bad_video("the video refers to media outside the file")


def _boxes(
    data: bytes, start: int, end: int, depth: int, budget: list[int]
) -> list[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of every box under [start, end), depth first."""
    found: list[tuple[bytes, int, int]] = []
    pos = start
    while pos + 8 <= end and depth < 16:
        budget[0] -= 1
        if budget[0] < 0:
            raise bad_video("the video's header has too many boxes")
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1 and pos + 16 <= end:
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            break  # a truncated tail: the decoder will say whether the file is usable
        body = pos + header + (4 if kind == b"meta" else 0)
        found.append((kind, body, pos + size))
        if kind in _CONTAINERS or kind == b"rmra":
            found += _boxes(data, body, pos + size, depth + 1, budget)
        pos += size
    return found


def _dref_self_contained(data: bytes, start: int, end: int) -> bool:
    """Every entry of a `dref` box has the self-contained flag (the data is in this file)."""
    if start + 8 > end:
        return False
    count = struct.unpack_from(">I", data, start + 4)[0]
    pos = start + 8
    for _ in range(count):
        if pos + 12 > end:
            return False
        size, _kind, flags = struct.unpack_from(">I4sI", data, pos)
        if not flags & 1 or size < 12:
            return False
        pos += size
    return True


# ---------------------------------------------------------------------------------------------
# Header probe
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoHeader:
    width: int
    height: int
    frames: int  # as the container declares it (0: not declared)
    seconds: float  # duration (0.0: not declared)


# A list no FFmpeg protocol is on: whatever a file names (a segment, a data reference, an RTP
# stream) cannot be opened, only the in-memory buffer the container reads from.
NO_PROTOCOLS = "none"
DEMUXER_OPTIONS = {MP4: {"enable_drefs": "0", "use_absolute_path": "0"}, MATROSKA: {}, AVI: {}}


def open_container(data: bytes, demuxer: str) -> Any:
    """The one way a client's video reaches FFmpeg: an allowlisted demuxer named explicitly (no
    probing, so no other demuxer can claim the bytes), reading the in-memory buffer, with no
    protocol for anything the file names. Raises the client's MediaError."""
    import av  # only CPU workers open videos

    if demuxer not in DEMUXER_OPTIONS:
        raise bad_video(f"demuxer {demuxer!r} is not allowed", code="unsupported_video_format")
    options = {"protocol_whitelist": NO_PROTOCOLS, **DEMUXER_OPTIONS[demuxer]}
    try:
        return av.open(io.BytesIO(data), mode="r", format=demuxer, options=options)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise bad_video("cannot open the video: not a supported video file") from exc


def video_errors() -> tuple[type[Exception], ...]:
    """What FFmpeg (through PyAV) raises for bad data."""
    import av

    return (av.FFmpegError, ValueError, OSError)


def probe_video(data: bytes, demuxer: str) -> VideoHeader:
    """Frame size, frame count and duration from the container header; no frame is decoded."""
    with open_container(data, demuxer) as container:
        return read_header(container)


def read_header(container: Any) -> VideoHeader:
    """The header of an open container's first video stream (see `probe_video`)."""
    try:
        if not container.streams.video:
            raise bad_video("the file has no video stream")
        stream = container.streams.video[0]
        seconds = _seconds(stream, container)
        ctx = stream.codec_context
        return VideoHeader(int(ctx.width), int(ctx.height), int(stream.frames or 0), seconds)
    except video_errors() as exc:
        raise bad_video("cannot open the video: not a supported video file") from exc


def _seconds(stream: object, container: object) -> float:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else 0.0


def check_video_header(header: VideoHeader, limits: MediaLimits) -> None:
    """Refuse a video whose header already shows it is beyond the limits."""
    if min(header.width, header.height) < max(1, limits.min_side):
        raise bad_video(f"video frames are {header.width}x{header.height}: too small")
    if header.width * header.height > limits.max_pixels:
        raise bad_video(
            f"video frames are {header.width}x{header.height}: outside the allowed frame size "
            f"({limits.max_pixels} pixels)",
            code="video_too_large",
        )
    check_video_length(header.frames, header.seconds, limits)


def check_video_length(frames: int, seconds: float, limits: MediaLimits) -> None:
    if frames > limits.max_video_frames:
        raise bad_video(
            f"the video has {frames} frames; the limit is {limits.max_video_frames}",
            code="video_too_large",
        )
    if seconds > limits.max_video_seconds:
        raise bad_video(
            f"the video lasts {seconds:.0f} s; the limit is {limits.max_video_seconds:g} s",
            code="video_too_large",
        )
