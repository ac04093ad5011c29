"""`--reasoning-parser`: the thinking section of a reply, split from its content (pure logic).

Three rules, named as vLLM names them:
- `qwen3`: a reply that begins with `<think>` thinks until `</think>`; any other reply is all
  content (Qwen3 and its hybrid templates, where `enable_thinking: false` closes the section in
  the prompt).
- `deepseek_r1`: the reply thinks from its first character (the template opened `<think>` in
  the prompt, as the Qwen3-VL Thinking templates do) until `</think>`; a leading `<think>` is
  dropped.
- `glm45`: GLM-4.1V-Thinking's `<think>...</think><answer>...</answer>`: the `qwen3` rule, and
  the content's `<answer>` and `</answer>` tags are dropped (what they wrap is the content).
A reply that never closes its section is all thinking. Streamed and whole replies split the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.grammar import ThinkSection
from tokenizer_manager.api.tool_parser import partial_tag_length

THINK_START, THINK_END = "<think>", "</think>"
ANSWER_TAGS = ("<answer>", "</answer>")  # the glm45 rule's content wrapper


@dataclass
class ReasoningStream:
    """Incremental splitter: `feed` returns (reasoning, content) ready to send."""

    rule: str
    _text: str = ""  # held: what cannot be placed yet
    _state: str = "start"  # start -> thinking -> content
    thought: bool = False  # the reply had a thinking section

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        if self._state == "start":
            self._decide()
        if self._state == "thinking":
            return self._think(), ""
        if self._state == "content":
            return "", self._content(final=False)
        return "", ""

    @property
    def over(self) -> bool:
        """The thinking section (if any) has closed: what follows is content."""
        return self._state == "content"

    def _decide(self) -> None:
        if self.rule == "deepseek_r1" or self._text.startswith(THINK_START):
            if THINK_START.startswith(self._text):
                return  # could still be the opening tag: wait
            self._text = self._text.removeprefix(THINK_START)
            self._state, self.thought = "thinking", True
        elif not THINK_START.startswith(self._text):
            self._state = "content"

    def _think(self) -> str:
        end = self._text.find(THINK_END)
        if end >= 0:
            reasoning, self._text = self._text[:end], self._text[end + len(THINK_END) :]
            self._state = "content"
            return reasoning
        keep = partial_tag_length(self._text, THINK_END)
        reasoning, self._text = (
            self._text[: len(self._text) - keep],
            self._text[-keep:] if keep else "",
        )
        return reasoning

    def _content(self, final: bool) -> str:
        """The held content, less the glm45 rule's answer tags (and, until `final`, a tail
        that may begin one)."""
        text, self._text = self._text, ""
        if self.rule != "glm45":
            return text
        for tag in ANSWER_TAGS:
            text = text.replace(tag, "")
        keep = 0 if final else max(partial_tag_length(text, tag) for tag in ANSWER_TAGS)
        if keep:
            text, self._text = text[:-keep], text[-keep:]
        return text

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an unclosed section's tail is thinking."""
        if self._state == "start" and self.rule != "deepseek_r1":
            self._state = "content"
        self.thought = self.thought or self._state == "start"
        if self._state == "content":
            return "", self._content(final=True)
        text, self._text = self._text, ""
        return text, ""


def split_reasoning(rule: str, text: str) -> tuple[str | None, str]:
    """(the thinking section or None, the content) of a whole reply."""
    stream = ReasoningStream(rule)
    first, rest = stream.feed(text), stream.finish()
    reasoning, content = first[0] + rest[0], first[1] + rest[1]
    return (reasoning if stream.thought else None), content


def think_section(rule: str, token_id: Callable[[str], int | None]) -> ThinkSection | None:
    """The thinking section as a constraint sees it: `</think>` (and, for the rules where the
    reply opens its section, qwen3 and glm45, `<think>`) as single tokens (`token_id` maps a
    token to its id, None when the vocabulary has no such token); None when they are not."""
    opens = rule != "deepseek_r1"
    end = token_id(THINK_END)
    start = token_id(THINK_START) if opens else None
    if end is None or (opens and start is None):
        return None
    return ThinkSection(end, start)
