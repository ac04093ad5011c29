"""Bounds a constraint must meet before any grammar engine sees it, checked in pure Python.

The engine compiles recursively: a JSON document nested past its parser's depth is an engine
error, and a long chain of grammar rules or `$ref`s recurses once per link until the compiling
thread runs out of stack, which ends the whole process (SIGSEGV; with llguidance 1.9.1 and an
8 MiB thread stack, about 2,600 chained Lark rules or 2,200 chained `$ref`s). Bounding the
depth of a schema, the number of its `$ref`s and the number of a grammar's rules bounds those
chains, far below what crashes a compile thread of `CompileLimits.stack_bytes`. These checks are
cheap (one pass over the text or the parsed schema); the front end's compile worker processes
catch what they do not foresee.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.grammar.base import GrammarError, GrammarSpec

# a rule definition opens a line: `name ::=` (GBNF) or `name:` / `?name.2:` / `NAME:` (Lark)
RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(::=|:)", re.MULTILINE)


@dataclass(frozen=True)
class StructureLimits:
    max_json_depth: int = 100  # nesting of a schema document (llguidance's JSON parser: 128)
    max_refs: int = 2000  # `$ref`s in a schema (each may be a link of one chain)
    max_rules: int = 2000  # rule definitions in a grammar (each may be a link of one chain)


def check_structure(spec: GrammarSpec, limits: StructureLimits) -> None:
    """GrammarError naming `spec.param` when the constraint is nested or chained past the
    limits; nothing else is judged here."""
    if spec.kind in ("json_schema", "structural_tag"):
        depth, refs = json_shape(spec.text_json)
        if depth > limits.max_json_depth:
            raise GrammarError(
                f"the schema is nested {depth} levels deep; the limit is {limits.max_json_depth}",
                spec.param,
            )
        if refs > limits.max_refs:
            raise GrammarError(
                f"the schema has {refs} $refs; the limit is {limits.max_refs}", spec.param
            )
    elif spec.kind == "ebnf":
        rules = len(RULE_DEFINITION.findall(spec.text))
        if rules > limits.max_rules:
            raise GrammarError(
                f"the grammar has {rules} rules; the limit is {limits.max_rules}", spec.param
            )


def json_shape(value: object) -> tuple[int, int]:
    """The nesting depth of a parsed JSON document (a scalar is 0) and its `$ref` keys, walked
    without recursion."""
    depth, refs = 0, 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            refs += "$ref" in node
            children: list[object] = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level + 1)
        stack.extend((child, level + 1) for child in children)
    return depth, refs
