"""Hostile inputs built in code (issue 57), for the tests and `scripts/stress.py --attacks`:
chains that make the grammar engine recurse once per link, a schema nested past its JSON
parser's depth, slow but valid GBNF grammars, a grammar whose parse grows without bound while
decoding, and image headers padded with thousands of empty pieces."""

from __future__ import annotations

import io
import random
from typing import Any

from PIL import Image


def lark_chain(links: int) -> str:
    """A Lark grammar of `links` rules, each naming the next."""
    rules = [f'r{i}: "a" r{i + 1}' for i in range(links)]
    return "\n".join(["start: r0", *rules, f'r{links}: "b"'])


def ref_chain(links: int) -> dict[str, Any]:
    """A JSON schema of `links` definitions, each a `$ref` to the next."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def slow_gbnf(links: int, seed: int) -> str:
    """A valid GBNF chain: converting GBNF to the engine's form takes time quadratic in the
    chain (about 7 s of one core for 2,000 links, 60 KB)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(links)]
    rules = [f'r{i} ::= "{w}" | [a-z] r{i + 1}' for i, w in enumerate(words)]
    return "\n".join(["root ::= r0", *rules, f'r{links} ::= "x"'])


AMBIGUOUS = 'root ::= s\ns ::= s s | s s s | s s s s | "a" | "b"'
"""Every string of a's and b's parses in exponentially many ways: the engine's parser rows
grow with each token until its per-step limit ends the request."""

EMPTY_APP0 = b"\xff\xe0\x00\x02"  # a JPEG APP0 marker whose length counts only itself


def jpeg(size: tuple[int, int] = (32, 24), **save: object) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 10)).save(buf, "JPEG", **save)
    return buf.getvalue()


def padded_jpeg(segments: int) -> bytes:
    """A valid JPEG with `segments` empty APP0 segments after its start marker."""
    data = jpeg()
    return data[:2] + EMPTY_APP0 * segments + data[2:]
