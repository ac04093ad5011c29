"""Hostile constraints built in code (issue 57): chains that make the engine recurse once per
link, a schema nested past its JSON parser's depth, and slow but valid GBNF grammars."""

from __future__ import annotations

import random
from typing import Any


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
