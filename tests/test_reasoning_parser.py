"""The reasoning splitter, whole and streamed (pure logic)."""

from __future__ import annotations

import pytest

from tokenizer_manager.api.reasoning_parser import ReasoningStream, split_reasoning

CASES = [
    ("qwen3", "<think>\nThe user asks.\n</think>\n\nHello!", "\nThe user asks.\n", "\n\nHello!"),
    ("qwen3", "Hello, no thinking.", None, "Hello, no thinking."),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("deepseek_r1", "Thinking.</think>Answer.", "Thinking.", "Answer."),
    ("deepseek_r1", "<think>Thinking.</think>Answer.", "Thinking.", "Answer."),
    ("deepseek_r1", "all thinking </thin", "all thinking </thin", ""),
]


@pytest.mark.parametrize(("rule", "text", "reasoning", "content"), CASES)
def test_whole_replies(rule: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(rule, text) == (reasoning, content)


@pytest.mark.parametrize(("rule", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_streamed_in_any_pieces_splits_the_same(
    rule: str, text: str, reasoning: str | None, content: str, size: int
) -> None:
    stream, parts = ReasoningStream(rule), []
    for i in range(0, len(text), size):
        parts.append(stream.feed(text[i : i + size]))
    parts.append(stream.finish())
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content
    assert not any("<think>" in r or "</think>" in r for r, _ in parts)
