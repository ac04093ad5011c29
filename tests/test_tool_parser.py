"""The Qwen tool-call parser, whole and streamed (pure logic)."""

from __future__ import annotations

import json

import pytest

from tokenizer_manager.api.tool_parser import ParsedToolCall, ToolCallStream, parse_tool_calls

WEATHER = (
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
)
TWO = WEATHER + "\n" + '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'


def test_a_call_with_text_before_it() -> None:
    content, calls = parse_tool_calls("Let me look.\n" + WEATHER)
    assert content == "Let me look."
    assert calls == [ParsedToolCall("weather", '{"city": "Paris", "unit": "C"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "C"}


def test_two_calls_and_no_content() -> None:
    content, calls = parse_tool_calls(TWO)
    assert content == "" and [c.name for c in calls] == ["weather", "time"]
    assert calls[1].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # never closed
        "a < b and <tool",
    ],
)
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text.strip()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_streaming_in_any_pieces_gives_the_same_result(size: int) -> None:
    text = "Sure <b>.\n" + TWO + " done <tool"
    stream, content = ToolCallStream(), []
    for i in range(0, len(text), size):
        content.append(stream.feed(text[i : i + size]))
        assert "<tool_call" not in "".join(content)
    content.append(stream.finish())
    whole_content, whole_calls = parse_tool_calls(text)
    assert "".join(content).strip() == whole_content == "Sure <b>.\n\n done <tool"
    assert stream.calls == whole_calls


def test_new_calls_reports_each_call_once() -> None:
    stream = ToolCallStream()
    stream.feed(WEATHER[:20])
    assert stream.new_calls() == []
    stream.feed(WEATHER[20:])
    assert [c.name for c in stream.new_calls()] == ["weather"]
    assert stream.new_calls() == []
