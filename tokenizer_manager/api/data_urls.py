"""Base64 data: URLs taken out of a request body before its JSON is parsed.

A chat that resends two 448x448 PNG images carries 1.6 MB of base64 in two JSON strings. orjson
parses such a body in about 1.1-1.4 ms, nearly all of it checking the strings character by
character (UTF-8, escapes); the same bytes become `str` objects in 0.18 ms by an ASCII decode.
So before the parse, `lift_data_urls` finds each long data: URL in the raw bytes, decodes it as
ASCII, and leaves in the body a short placeholder string; `put_back` swaps the placeholders in
the parsed value for the URLs. What the request model and everything after it see is exactly
what parsing the whole body gives (the same `str` values), so no other code knows of this.

A span is lifted only when it is certainly the whole content of a JSON string that is an object's
value: a `"data:` whose quote follows a `:` (an escaped quote follows a backslash, a key a `{`
or `,`; at most `MAX_GAP` bytes of white space between), at least `MIN_LIFT` bytes up to the next
quote, with no backslash (no escape: the next
quote closes the string; `\\/` in base64 keeps a URL in the ordinary parse) and ASCII only. The
quotes stay where they were and the placeholder holds neither a quote nor an unfinished escape,
so a body is valid JSON after lifting exactly when it was before. The placeholder carries a
random per-process prefix: a client cannot name one of them, and one that did would only get
back a URL of its own request.
"""

from __future__ import annotations

import secrets
from typing import Any

MIN_LIFT = 4096  # shorter data: URLs are parsed as they are (the parse is cheap for them)
# Bounds on the Python-level work per body (the scan runs on the event loop): at most this many
# `"data:` candidates are looked at (the rest of the body is parsed as usual) and at most this
# much white space between a value's colon and its quote. Without them a 4 MiB body of short
# `"data:"` strings, or of white space before one URL, held the loop for 0.3-0.4 s.
MAX_CANDIDATES = 256
MAX_GAP = 16
_START = b'"data:'
_WHITESPACE = b" \t\r\n"
_TAG = f"tessera-data-url-{secrets.token_hex(8)}-"
_PLACEHOLDER = "\x00" + _TAG  # the parsed placeholder, then the URL's number
_PLACEHOLDER_JSON = ("\\u0000" + _TAG).encode()  # the same as JSON text


def lift_data_urls(body: bytes) -> tuple[bytes, dict[str, str]]:
    """(the body with each liftable data: URL replaced by a placeholder, placeholder -> URL).
    Returns `body` itself and {} when there is nothing to lift. Pure."""
    start = body.find(_START) if len(body) >= MIN_LIFT else -1
    if start < 0:
        return body, {}
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    urls: dict[str, str] = {}
    done = 0
    for _ in range(MAX_CANDIDATES):
        if start < 0:
            break
        end = body.find(b'"', start + 1)
        if end < 0:
            break
        url = _liftable(body, view, start, end)
        if url is not None:
            pieces += [view[done : start + 1], _PLACEHOLDER_JSON + str(len(urls)).encode()]
            urls[f"{_PLACEHOLDER}{len(urls)}"] = url
            done = end
        start = body.find(_START, end + 1)
    if not urls:
        return body, {}
    pieces.append(view[done:])
    return b"".join(pieces), urls


def _liftable(body: bytes, view: memoryview, start: int, end: int) -> str | None:
    """The URL between the quote at `start` and the one at `end`, when it may be lifted."""
    if end - start - 1 < MIN_LIFT or not _follows_colon(body, start):
        return None
    if body.find(b"\\", start + 1, end) >= 0:
        return None
    try:
        return str(view[start + 1 : end], "ascii")
    except UnicodeDecodeError:
        return None


def _follows_colon(body: bytes, quote: int) -> bool:
    i = quote - 1
    while i >= 0 and quote - i <= MAX_GAP and body[i] in _WHITESPACE:
        i -= 1
    return i >= 0 and body[i] == ord(":")


def put_back(value: Any, urls: dict[str, str]) -> Any:
    """`value` (parsed JSON) with every placeholder string in it replaced by its URL; walks
    the value without recursion (a body may nest 1024 levels deep)."""
    if isinstance(value, str):
        return _url_for(value, urls)
    todo = [value]
    while todo:
        node = todo.pop()
        keys = node.keys() if isinstance(node, dict) else range(len(node))
        for key in keys:
            item = node[key]
            if isinstance(item, str):
                node[key] = _url_for(item, urls)
            elif isinstance(item, (dict, list)):
                todo.append(item)
    return value


def _url_for(text: str, urls: dict[str, str]) -> str:
    return urls.get(text, text) if text.startswith(_PLACEHOLDER) else text
