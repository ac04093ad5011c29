"""The one usage recorder: what the HTTP layer has served since start-up (/server_info "api",
/metrics tessera_api_*). Every route records a finished request here, streamed or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.io_struct import StrOutput
from tokenizer_manager.protocol import usage


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
        """`lasts`: the final output of each choice of the request's engine requests (the
        choices of one engine request share its prompt: counted once, with its choice 0)."""
        self.counters.prompt_tokens += sum(last.prompt_tokens for last in lasts if not last.index)
        self.counters.cached_tokens += sum(last.cached_tokens for last in lasts if not last.index)
        self.counters.completion_tokens += sum(last.completion_tokens for last in lasts)


def usage_json(lasts: list[StrOutput]) -> dict[str, Any]:
    """OpenAI's usage object for the final outputs of a request's choices (a prompt counts
    once, with its choice 0)."""
    return usage(
        sum(last.prompt_tokens for last in lasts if not last.index),
        sum(last.completion_tokens for last in lasts),
        sum(last.cached_tokens for last in lasts if not last.index),
    )


def running_usage(out: StrOutput, completion_tokens: int | None = None) -> dict[str, Any]:
    """One choice's usage so far, as a continuous-usage chunk carries it: every choice counts
    its prompt; `completion_tokens` overrides the output's (0 for an opening chunk)."""
    done = out.completion_tokens if completion_tokens is None else completion_tokens
    return usage(out.prompt_tokens, done, out.cached_tokens)
