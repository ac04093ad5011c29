"""The reasoning splitter, whole and streamed (pure logic)."""

from __future__ import annotations

import pytest

from tokenizer_manager.api.reasoning_parser import ReasoningStream, split_reasoning, think_section

CASES = [
    ("qwen3", "<think>\nThe user asks.\n</think>\n\nHello!", "\nThe user asks.\n", "\n\nHello!"),
    ("qwen3", "Hello, no thinking.", None, "Hello, no thinking."),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("deepseek_r1", "Thinking.</think>Answer.", "Thinking.", "Answer."),
    ("deepseek_r1", "<think>Thinking.</think>Answer.", "Thinking.", "Answer."),
    ("deepseek_r1", "all thinking </thin", "all thinking </thin", ""),
    # GLM-4.1V-Thinking: the answer's wrapper is no part of the content
    ("glm45", "<think>Look.</think><answer>A cat.</answer>", "Look.", "A cat."),
    ("glm45", "<think>\nLook.\n</think>\n<answer>A <b>cat</b>.</answer>", "\nLook.\n",
     "\nA <b>cat</b>."),
    ("glm45", "<answer>No thinking.</answer>", None, "No thinking."),
    ("glm45", "<think>never closed <answer>", "never closed <answer>", ""),
    ("glm45", "<think>a</think>cut <answ", "a", "cut <answ"),
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
    if rule == "glm45":
        assert not any("answer>" in c for _, c in parts)


def test_the_glm_rule_is_the_glm4v_checkpoints_own(tmp_path) -> None:  # noqa: ANN001
    """`--reasoning-parser auto` picks the checkpoint family's rule: glm45 for GLM-4.1V, none for
    a family that declares none; a named rule stays as given."""
    from runtime.server_args import ServerArgs
    from runtime.tiny_checkpoint import make_checkpoint

    rules = {}
    for arch in ("glm4v", "qwen2_vl"):
        folder = make_checkpoint(arch, tmp_path / arch)
        rules[arch] = ServerArgs(model_path=str(folder), reasoning_parser="auto").resolve()
    assert {arch: args.reasoning_parser for arch, args in rules.items()} == {
        "glm4v": "glm45", "qwen2_vl": None,
    }  # fmt: skip
    named = ServerArgs(model_path=str(tmp_path / "glm4v"), reasoning_parser="qwen3").resolve()
    assert named.reasoning_parser == "qwen3"


def test_glm_rule_constrains_after_a_think_it_opens() -> None:
    ids = {"<think>": 7, "</think>": 8}
    section = think_section("glm45", ids.get)
    assert section is not None and (section.start_id, section.end_id) == (7, 8)
    assert think_section("glm45", {"</think>": 8}.get) is None
