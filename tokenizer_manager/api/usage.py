"""The one usage recorder: what the HTTP layer has served since start-up (/server_info "api",
/metrics tessera_api_*). Every route records a finished request here, streamed or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.io_struct import StrOutput


@dataclass
class ApiCounters:
    """What the HTTP layer has seen since start-up."""

    requests: int = 0
    client_errors: int = 0
    server_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class UsageRecorder:
    """Adds each finished request's token counts to the counters, once."""

    def __init__(self, counters: ApiCounters) -> None:
        self.counters = counters

    def record(self, lasts: list[StrOutput]) -> None:
        """`lasts`: the final output of each choice (they share one prompt)."""
        self.counters.prompt_tokens += lasts[0].prompt_tokens
        self.counters.cached_tokens += lasts[0].cached_tokens
        self.counters.completion_tokens += sum(last.completion_tokens for last in lasts)


def usage_json(lasts: list[StrOutput]) -> dict[str, Any]:
    """OpenAI's usage object for the final outputs of a request's choices."""
    prompt = lasts[0].prompt_tokens
    completion = sum(last.completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": lasts[0].cached_tokens},
    }
