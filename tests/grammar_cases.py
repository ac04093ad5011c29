"""Constraints shared by the structured-output tests and scripts/bench_structured.py: JSON
schemas that cover nested objects, bounded arrays, enums, number ranges, anyOf, string patterns
and $ref, plus regexes, a choice and an EBNF grammar. Every string is bounded or short-lived, so
a noise model sampling from the masked distribution ends in a few hundred tokens.

    python tests/grammar_cases.py > cases.json       # the constraints as JSON, for other tools
"""

from __future__ import annotations

import argparse
import json

SCHEMAS: list[dict] = [
    {  # flat object: bounded string, integer range, boolean
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "invoice": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "vendor": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "vendor"],
                "additionalProperties": False,
            }
        },
        "required": ["invoice"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": [1, 2, "XL", None]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    {"type": "number", "minimum": -10.5, "maximum": 99.25},
    {  # anyOf
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]},
            "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
        },
        "required": ["value", "note"],
        "additionalProperties": False,
    },
    {  # string patterns
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        },
        "required": ["code", "email"],
        "additionalProperties": False,
    },
    {  # array of objects with bounds
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "y": {"type": "number"},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # optional properties
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "string", "maxLength": 4},
            "c": {"type": "boolean"},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {  # nested arrays with bounds
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # exclusive bounds, const, string length range
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "label": {"type": "string", "minLength": 2, "maxLength": 6},
        },
        "required": ["kind", "score", "label"],
        "additionalProperties": False,
    },
    {  # $defs and $ref
        "$defs": {"pair": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/pair"}, "right": {"$ref": "#/$defs/pair"}},
        "required": ["left", "right"],
        "additionalProperties": False,
    },
]

REGEXES: list[str] = [
    r"[0-9]{3}-[a-z]{2,5}",
    r"(cat|dog)s? (are|is) (good|bad)",
    r"-?(0|[1-9][0-9]*)\.\d",
]
CHOICES: list[str] = ['say "yes"', "no\\", "maybe later", "ünïcode"]
# GBNF, as xgrammar and llama.cpp write it (llguidance converts it to Lark)
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
EBNF_PATTERN = r"\([0-9]+(\+[0-9]+)*\)"


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the benchmark constraints as JSON")
    parser.parse_args()
    cases = {"json_schema": SCHEMAS, "regex": REGEXES, "choice": CHOICES, "ebnf": EBNF}
    print(json.dumps(cases, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
