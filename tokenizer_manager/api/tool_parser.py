"""Tool calls in the Qwen family's format: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks in the generated text (pure logic).

`parse_tool_calls` splits a whole text into its content and its calls; `ToolCallStream` does the
same for a stream of text deltas: content passes through as it comes (less a tail that may be the
start of a `<tool_call>` tag), and each call comes out whole once its block closes. A block whose
JSON does not parse, or names no function, stays in the content, as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool calls carry it


def parse_block(body: str) -> ParsedToolCall | None:
    """The call in the text between the tags, or None if it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(data["name"], text)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(the content around the calls, stripped; the calls in order)."""
    stream = ToolCallStream()
    content = stream.feed(text) + stream.finish()
    return content.strip(), stream.calls


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallStream:
    """Incremental parser: `feed` returns the content ready to send; finished calls are appended
    to `calls` (`new_calls` says how many since the last look)."""

    calls: list[ParsedToolCall] = field(default_factory=list)
    _held: str = ""  # content that may be the start of a tag
    _block: str | None = None  # the body of an open block
    _seen: int = 0

    def feed(self, delta: str) -> str:
        text, out = self._held + delta, []
        self._held = ""
        while text:
            if self._block is None:
                text = self._in_content(text, out)
            else:
                text = self._in_block(text, out)
        return "".join(out)

    def _in_content(self, text: str, out: list[str]) -> str:
        start = text.find(TOOL_START)
        if start < 0:
            keep = partial_tag_length(text, TOOL_START)
            out.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            return ""
        out.append(text[:start])
        self._block = ""
        return text[start + len(TOOL_START) :]

    def _in_block(self, text: str, out: list[str]) -> str:
        body = self._block + text
        end = body.find(TOOL_END)
        if end < 0:
            self._block = body
            return ""
        self._block = None
        call = parse_block(body[:end])
        if call is None:
            out.append(f"{TOOL_START}{body[:end]}{TOOL_END}")
        else:
            self.calls.append(call)
        return body[end + len(TOOL_END) :]

    def finish(self) -> str:
        """What is left at the end of the text: a held tail, or an unclosed block as text."""
        rest = self._held if self._block is None else TOOL_START + self._block
        self._held, self._block = "", None
        return rest

    def new_calls(self) -> list[ParsedToolCall]:
        fresh = self.calls[self._seen :]
        self._seen = len(self.calls)
        return fresh
