"""POST /v1/completions: a prompt (text or token ids) in, text_completion objects out."""

from __future__ import annotations

from typing import Any

from runtime.io_struct import StrOutput
from runtime.sampling_params import SamplingParams
from tokenizer_manager.api.base import check_model
from tokenizer_manager.api.fields import refuse_fields
from tokenizer_manager.api.logprobs import CompletionLogprobs
from tokenizer_manager.api.openai_common import (
    Envelope,
    OpenAIServing,
    OpenAIStream,
    engine_values,
    openai_sampling,
    stream_usage,
)
from tokenizer_manager.api.outputs import finish_reason
from tokenizer_manager.api.structured import OPENAI_READERS
from tokenizer_manager.protocol import COMPLETION_REFUSED, APIError, CompletionRequest
from tokenizer_manager.tokenizer_manager import GenerateInput

MAX_PROMPTS = 64  # prompts in one request


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The request's prompts: one text, one token-id list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return list(prompt)


def completion_choice(
    index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def echo_of(echoes: list[str], index: int, n: int) -> str:
    """Choice `index`'s prompt as echoed ("" without echo): choice j of prompt i is i * n + j."""
    return echoes[index // n] if echoes else ""


class CompletionStream(OpenAIStream):
    """A completions request's chunks: each prompt first when echoed, then text deltas (each
    choice's `index` is its prompt's), then usage if asked."""

    def __init__(
        self,
        envelope: Envelope,
        usage: tuple[bool, bool],
        echoes: list[str] | None = None,
        n: int = 1,
    ) -> None:
        super().__init__(envelope, usage)
        self.echoes = echoes or []
        self.n = n
        self.logprobs: dict[int, CompletionLogprobs] = {}  # per choice: text_offset runs on

    def opening(self, firsts: list[StrOutput]) -> list[dict[str, Any]]:
        """Each choice's echoed prompt (none without echo); choice i's prompt is i // n."""
        return [
            self.chunk(
                completion_choice(i, echo_of(self.echoes, i, self.n), None),
                firsts[i // self.n],
                completion_tokens=0,
            )
            for i in range(len(self.echoes) * self.n)
        ]

    def chunks(self, out: StrOutput, index: int = 0) -> list[dict[str, Any]]:
        reason = finish_reason(out)
        if not out.text and reason is None and not out.logprobs:
            return []
        offsets = len(echo_of(self.echoes, index, self.n))
        logprobs = self.logprobs.setdefault(index, CompletionLogprobs(offsets)).build([out])
        choice = completion_choice(index, out.text, reason, logprobs)
        return [self.chunk(choice, out)]


class CompletionServing(OpenAIServing[CompletionRequest]):
    objects = ("text_completion", "text_completion")
    id_prefix = "cmpl"

    def to_inputs(self, req: CompletionRequest) -> tuple[str, list[GenerateInput]]:
        """One internal request per prompt; the response carries one choice per prompt."""
        check_model(self.tm, req.model)
        self.ctx.unknown.check(req, COMPLETION_REFUSED.keys() | OPENAI_READERS.keys())
        refuse_fields(req, COMPLETION_REFUSED)
        engine = engine_values(req, self.ctx.defaults) | {"logprobs": req.logprobs, "n": req.n}
        prompts = prompt_list(req.prompt)
        rid = self.request_id(req)
        rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        return rid, [self.one_input(r, p, req, engine) for r, p in zip(rids, prompts)]

    def one_input(
        self, rid: str, prompt: str | list[int], req: CompletionRequest, engine: dict[str, Any]
    ) -> GenerateInput:
        ids, text = (None, prompt) if isinstance(prompt, str) else (prompt, None)
        return GenerateInput(
            rid,
            req.stream,
            lambda room: self.sampling(req, room, engine),
            req.max_tokens,
            req.n,
            text=text,
            input_ids=ids,
        )

    def echoes(self, req: CompletionRequest) -> list[str]:
        """echo: each prompt as text (token ids decoded), else nothing."""
        if not req.echo:
            return []
        return [
            p if isinstance(p, str) else self.tm.tokenizer.decode(p)
            for p in prompt_list(req.prompt)
        ]

    def sampling(self, req: CompletionRequest, room: int, engine: dict[str, Any]) -> SamplingParams:
        """A completions request's sampling fields as SamplingParams."""
        return openai_sampling(req, req.max_tokens, room, self.ctx.defaults, engine)

    def stream_writer(self, rid: str, req: CompletionRequest) -> CompletionStream:
        return CompletionStream(self.envelope(rid), stream_usage(req), self.echoes(req), req.n)

    def response(
        self, rid: str, req: CompletionRequest, choices: list[list[StrOutput]]
    ) -> dict[str, Any]:
        echoes = self.echoes(req)
        built = []
        for i, outputs in enumerate(choices):
            echo = echo_of(echoes, i, req.n)
            text = echo + "".join(o.text for o in outputs)
            logprobs = CompletionLogprobs(len(echo)).build(outputs)
            built.append(completion_choice(i, text, finish_reason(outputs[-1]), logprobs))
        return self.envelope(rid).whole(built, [c[-1] for c in choices])
