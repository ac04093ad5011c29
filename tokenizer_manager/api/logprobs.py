"""Logprobs in each API's shape, from the detokenizer's `OutputLogprobs` (the raw model
distribution: see runtime/sampling_controls.py): chat's `logprobs.content`, completions' legacy
object with `text_offset`, and SGLang's `output_token_logprobs` / `output_top_logprobs`."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import OutputLogprobs, StrOutput, TokenText

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out reads as this (vLLM's)


def entries(outputs: list[StrOutput]) -> list[OutputLogprobs]:
    return [e for out in outputs for e in out.logprobs or []]


def _value(token: TokenText) -> float:
    return max(token.logprob, LOGPROB_FLOOR)


def _chat_token(token: TokenText) -> dict[str, Any]:
    return {"token": token.text, "logprob": _value(token), "bytes": token.bytes}


def chat_logprobs(outputs: list[StrOutput]) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) `logprobs`: None when the request did not ask."""
    if all(out.logprobs is None for out in outputs):
        return None
    content = [
        {**_chat_token(e.chosen), "top_logprobs": [_chat_token(t) for t in e.top]}
        for e in entries(outputs)
    ]
    return {"content": content}


class CompletionLogprobs:
    """Completions' legacy logprobs; `text_offset` runs on across a stream's chunks."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset  # where the first output token's text starts (after an echo)

    def build(self, outputs: list[StrOutput]) -> dict[str, Any] | None:
        if all(out.logprobs is None for out in outputs):
            return None
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        body["text_offset"] = []
        for e in entries(outputs):
            body["tokens"].append(e.chosen.text)
            body["token_logprobs"].append(_value(e.chosen))
            top = {t.text: _value(t) for t in e.top}
            body["top_logprobs"].append({**top, e.chosen.text: _value(e.chosen)})
            body["text_offset"].append(self.offset)
            self.offset += len(e.chosen.text)
        return body


def native_logprobs(outputs: list[StrOutput], with_text: bool) -> dict[str, Any]:
    """SGLang's meta_info fields: [logprob, token id, text or None] per token and per top
    alternative."""

    def triple(token: TokenText) -> list[Any]:
        return [_value(token), token.token_id, token.text if with_text else None]

    found = entries(outputs)
    return {
        "output_token_logprobs": [triple(e.chosen) for e in found],
        "output_top_logprobs": [[triple(t) for t in e.top] for e in found],
    }
