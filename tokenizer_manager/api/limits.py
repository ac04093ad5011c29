"""The shape of a request bounded before it is validated: every later step that walks a chat
(validation, the template, media references) is then bounded too."""

from __future__ import annotations

from typing import Any

from tokenizer_manager.protocol import APIError


def content_parts(data: dict[str, Any]) -> int:
    """A chat's messages and content parts: a message with a list of parts counts each part,
    any other message counts one. Only list lengths are read: as cheap as the message count."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return 0
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        count += len(content) if isinstance(content, list) else 1
    return count


def check_content_parts(data: dict[str, Any], limit: int) -> None:
    count = content_parts(data)
    if count > limit:
        raise APIError(
            f"{count} messages and content parts in one request; the limit is {limit} "
            "(--max-content-parts)",
            param="messages",
            code="too_many_content_parts",
        )
