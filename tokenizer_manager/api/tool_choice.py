"""`tool_choice: "required"` and a named function, as a grammar over the Qwen tool-call format:
one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block (or several, one per
line, when parallel_tool_calls allows), whose JSON names one of the allowed tools and whose
arguments follow that tool's parameter schema. The reply's tool parser then returns the blocks
as `tool_calls`."""

from __future__ import annotations

import json
from typing import Any

from runtime.grammar import GrammarSpec
from tokenizer_manager.api.tool_parser import TOOL_END, TOOL_START
from tokenizer_manager.protocol import APIError, Tool

COMPACT = {"whitespace_flexible": False, "lenient": False}  # JSON as the format writes it


def forced_tools(tools: list[Tool] | None, tool_choice: Any) -> list[Tool] | None:
    """The tools one of which must be called, or None when the model may answer in text; a
    400 naming tool_choice for a value that is not none, auto, required or a tool of `tools`."""
    if tool_choice in (None, "none", "auto"):
        return None
    if not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    if tool_choice == "required":
        return tools
    name = named_function(tool_choice)
    picked = [t for t in tools if t.function.name == name]
    if not picked:
        raise APIError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return picked[:1]


def named_function(tool_choice: Any) -> str:
    is_function = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    function = tool_choice.get("function") if is_function else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return function["name"]


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """A call of any of `tools`: its name and arguments by its parameter schema."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"x-guidance": COMPACT, "anyOf": calls}


def tool_call_grammar(tools: list[Tool], parallel: bool) -> GrammarSpec:
    """A Lark grammar: one tool-call block, or several on their own lines when `parallel`."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f"call: {json.dumps(TOOL_START + chr(10))} body {json.dumps(chr(10) + TOOL_END)}"
    body = f"body: %json {json.dumps(call_schema(tools), ensure_ascii=False)}"
    return GrammarSpec("ebnf", "\n".join([start, call, body]), "tool_choice")
