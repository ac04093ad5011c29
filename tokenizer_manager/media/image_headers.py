"""A bound on what reading an image header costs: PIL reads a JPEG's marker segments, a PNG's
chunks and a GIF's extension sub-blocks one Python step each, so a small file made of empty
pieces costs far more than its size says (192 KB of empty JPEG APP0 segments: 67 ms; of empty
PNG chunks: 49 ms; of one-byte GIF comment sub-blocks: 16 ms, where an ordinary header takes
0.03 ms). `header_pieces` counts those pieces as PIL will walk them, with C-speed slicing and
at most `cap + 1` Python steps, before PIL is asked. Pure.

Ordinary images have a few dozen pieces before their pixel data (a camera JPEG with EXIF, XMP
and an ICC profile: about 15); big EXIF, XMP or ICC blocks are few large pieces, so the caps
refuse only files built of empty ones.
"""

from __future__ import annotations

MAX_HEADER_PIECES = 1024  # more: refused (400, image_url); PIL then spends at most ~2 ms
INLINE_HEADER_PIECES = 64  # at most this many: read on the event loop (~0.1 ms); else a thread

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_DATA = (b"IDAT", b"fdAT")  # PIL's header read stops at the first pixel data chunk
_JPEG_SOS = 0xDA  # start of scan: PIL's header read stops there
_JPEG_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xDA)])  # TEM, RSTn, SOI, EOI


def header_pieces(data: bytes, cap: int) -> int:
    """The pieces PIL's header reader steps through for `data`, counted up to `cap + 1`
    (0 for formats whose header is read in C or has a fixed size)."""
    if data[:2] == b"\xff\xd8":
        return _jpeg_pieces(data, cap)
    if data[:8] == _PNG_SIGNATURE:
        return _png_pieces(data, cap)
    if data[:3] == b"GIF":
        return _gif_pieces(data, cap)
    return 0


def _jpeg_pieces(data: bytes, cap: int) -> int:
    """Segments up to the start of scan; a junk byte or a fill byte between them counts one
    each (PIL skips them a byte at a time)."""
    pos, pieces, size = 2, 0, len(data)
    while pieces <= cap and pos + 1 < size:
        pieces += 1
        marker = data[pos + 1]
        if data[pos] != 0xFF or marker in (0x00, 0xFF):
            pos += 1  # junk or fill
        elif marker == _JPEG_SOS:
            return pieces
        elif marker in _JPEG_NO_LENGTH:
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return pieces


def _png_pieces(data: bytes, cap: int) -> int:
    """Chunks up to the first pixel data chunk."""
    pos, pieces, size = 8, 0, len(data)
    while pieces <= cap and pos + 8 <= size:
        pieces += 1
        if data[pos + 4 : pos + 8] in _PNG_DATA:
            return pieces
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")
    return pieces


def _gif_pieces(data: bytes, cap: int) -> int:
    """Extension sub-blocks up to the first image descriptor."""
    if len(data) < 13:
        return 0
    pos, pieces, size = 13, 0, len(data)
    if data[10] & 0x80:  # a global color table
        pos += 3 << ((data[10] & 7) + 1)
    while pieces <= cap and pos + 1 < size and data[pos] == 0x21:  # an extension
        pos += 2
        while pieces <= cap and pos < size:
            pieces += 1
            length = data[pos]
            pos += 1 + length
            if not length:
                break
    return pieces
